"""Throwaway A/B (results/engine_floor_h100.md, its last sections): one module-level setting of the engine, e.g.
decode.SAMPLE_PER_SM, at several values in one process. Forced-length steps with 8 rows a prompt (1 row: its own
prompt), and the RL step's early-stop rollout (8 prompts x 8, prompt 256, up to 1024 tokens, at the paired
temperature), alternating rounds; first, each value's sampled rollout against the first value's (same seed): the
tokens, and the logprobs on each row's common prefix (before its first differing draw).

    PYTHONPATH=. python results/engine_floor_raw/knob_ab.py decode.SAMPLE_PER_SM 2 8 16 --json ab.json
    PYTHONPATH=. python results/engine_floor_raw/knob_ab.py decode.SAMPLE_PER_SM,decode.SHARED_HEADS 8,32 8,16 2,32
    # a probe's own setting, with its patch applied (merges.patch adds these two):
    PYTHONPATH=. python results/engine_floor_raw/knob_ab.py decode.ATTN_MERGE,decode.NORM_MERGE 0,0 1,0 1,1
"""
import argparse, importlib, json, time
import torch, triton
import aqn
from engine.bench_gemm import copy_bandwidth
from engine.bench_rollout import PAIRED_TEMPERATURE, _add_lora, _bench_one, random_model, random_stop_ids
from engine import decode
from model import qwen25_config
from rollout import release

p = argparse.ArgumentParser()
p.add_argument("knob", help="module.NAME under engine/, e.g. decode.SAMPLE_PER_SM, or several joined by commas")
p.add_argument("values", nargs="+", help="one int a knob, joined by commas where there are several")
p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--new-tokens", type=int, default=192)
p.add_argument("--early", type=int, default=1, help="early-stop rollouts a value a round (0: none)")
p.add_argument("--json", default=None)
a = p.parse_args()
knobs = []
for k in a.knob.split(","):
    mod_name, name = k.rsplit(".", 1)
    knobs.append((importlib.import_module("engine." + mod_name), name))
    assert hasattr(*knobs[-1]), k


def set_knobs(v):
    for (mod, name), x in zip(knobs, v.split(","), strict=True):
        setattr(mod, name, int(x))


dev = torch.device("cuda")
copy = copy_bandwidth()
model = random_model(qwen25_config("7b"), "nvfp4", dev, seed=0)
_add_lora(model, 32)
print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; copy {copy:.2f} TB/s; "
      f"7b nvfp4 + LoRA r32, AQN 1e-2; prompt 256, 8 rows a prompt; {a.knob} in {a.values}", flush=True)
V = model.config.vocab_size
prompts = torch.randint(0, V, (8, 256), generator=torch.Generator().manual_seed(3)).tolist()
stops = random_stop_ids(V, 256, torch.Generator().manual_seed(1))
rows = []
with aqn.noise(model, 1e-2, torch.Generator(dev).manual_seed(0)):
    ref = None
    for v in a.values:
        release(model)
        set_knobs(v)
        r = decode.generate(model, prompts, n=8, max_new_tokens=64, temperature=1.0, seed=11)
        ref = r if ref is None else ref
        same = (r.tokens == ref.tokens).float().mean().item()
        d = (r.logprobs - ref.logprobs).abs().max().item()
        # a row's draws agree until the logits differ enough to flip one (the Gumbel noise is the same, a hash of
        # row, step and token): the logprobs on each row's common prefix are what tells rounding from a fault
        differ = r.tokens != ref.tokens
        T = differ.shape[1]
        prefix = torch.where(differ.any(1), differ.int().argmax(1), torch.full_like(differ[:, 0], T, dtype=torch.long))
        on = torch.arange(T, device=prefix.device)[None, :] < prefix[:, None]
        dp = (r.logprobs - ref.logprobs).abs()[on].max().item() if on.any() else 0.0
        print(f"  check {v}: tokens equal {same:.3f}, max |dlogprob| {d:.2e}; common prefixes "
              f"{prefix.float().mean():.1f} tokens a row on average, max |dlogprob| there {dp:.2e}", flush=True)
        rows.append(dict(kind="check", value=v, same=same, dlp=d, prefix=prefix.float().mean().item(), dlp_prefix=dp))
    for rnd in range(a.rounds):
        for v in (a.values if rnd % 2 == 0 else a.values[::-1]):
            release(model)
            set_knobs(v)
            for b in a.batches:
                n = 8 if b >= 8 else 1
                r = _bench_one(model, b // n, 256, a.new_tokens, seed=b, n=n)
                rows.append(dict(kind="forced", value=v, round=rnd, batch=b, ms_step=r["ms_step"]))
                print(f"  {v}, round {rnd}, {b} rows: {r['ms_step']:.3f} ms a step", flush=True)
            for i in range(a.early):
                kw = dict(n=8, max_new_tokens=1024, temperature=PAIRED_TEMPERATURE, stop_ids=stops, seed=21 + i)
                decode.generate(model, prompts, **kw)  # compiles and captures
                torch.cuda.synchronize()
                t = time.perf_counter()
                r = decode.generate(model, prompts, **kw)
                torch.cuda.synchronize()
                s = time.perf_counter() - t
                rows.append(dict(kind="early", value=v, round=rnd, seed=21 + i, s=s, steps=r.stats["steps"]))
                print(f"  {v}, round {rnd}, early-stop rollout seed {21 + i}: {s:.3f} s ({r.stats['steps']} steps)", flush=True)
            release(model)
print(f"| {a.knob} | " + " | ".join(f"{b} rows, ms a step" for b in a.batches) + " | early-stop rollout s |")
print("| --- |" + " --- |" * (len(a.batches) + 1))
for v in a.values:
    cells = [" / ".join(f"{r['ms_step']:.3f}" for r in rows if r["kind"] == "forced" and r["value"] == v and r["batch"] == b)
             for b in a.batches]
    cells.append(" / ".join(f"{r['s']:.3f}" for r in rows if r["kind"] == "early" and r["value"] == v))
    print(f"| {v} | " + " | ".join(cells) + " |")
if a.json:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, copy=copy,
                   args=vars(a), rows=rows), open(a.json, "w"), indent=1)
