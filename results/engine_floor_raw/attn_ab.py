"""Throwaway A/B (results/engine_floor_h100.md, "The attention's shared prompt over more programs, its registers
capped; the ride's refinement"): decode.SHARED_SUB (each chunk of a group's shared prompt split again over the
first SUB rows' programs of the ROWS read together) and decode.ATTN_MAXNREG (the attention kernel's registers
capped where a prompt is shared), in one process. Forced-length steps with shared prompts (8 rows a prompt) and
the RL step's early-stop rollout (8 prompts x 8, prompt 256, up to 1024 tokens, ~256 on average, at the paired
temperature), alternating rounds; the compiled attention kernel's registers and spills, per variant. Needs
attn_sub.patch applied:

    git apply results/engine_floor_raw/attn_sub.patch
    PYTHONPATH=. python results/engine_floor_raw/attn_ab.py --variants 1,0 2,0 1,128 4,0 --json ab.json
"""
import argparse, json, time
import torch, triton
import aqn
from engine import decode
from engine.bench_gemm import copy_bandwidth
from engine.bench_rollout import PAIRED_TEMPERATURE, _add_lora, _bench_one, random_model, random_stop_ids
from model import qwen25_config
from rollout import release

p = argparse.ArgumentParser()
p.add_argument("--variants", nargs="+", default=["1,0", "2,0", "1,128", "4,0"], help="SHARED_SUB,ATTN_MAXNREG")
p.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--new-tokens", type=int, default=192)
p.add_argument("--early", type=int, default=1, help="early-stop rollouts a variant a round (0: none)")
p.add_argument("--json", default=None)
a = p.parse_args()
a.subs = a.variants
regs = {}
kernel = decode._attn_partial_kernel


class Spy:  # records the compiled attention kernel's registers and spills, per variant
    def __getitem__(self, grid):
        def launch(*args, **kw):
            c = kernel[grid](*args, **kw)
            regs.setdefault((decode.SHARED_SUB, decode.ATTN_MAXNREG, kw["N_GROUP"] > 1),
                            (getattr(c, "n_regs", None), getattr(c, "n_spills", None)))
            return c
        return launch


decode._attn_partial_kernel = Spy()


def setv(v):
    s, m = (int(x) for x in v.split(","))
    decode.SHARED_SUB, decode.ATTN_MAXNREG = s, m
dev = torch.device("cuda")
copy = copy_bandwidth()
model = random_model(qwen25_config("7b"), "nvfp4", dev, seed=0)
_add_lora(model, 32)
print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; copy {copy:.2f} TB/s; "
      f"7b nvfp4 + LoRA r32, AQN 1e-2; prompt 256, 8 rows a prompt", flush=True)
V = model.config.vocab_size
gen = torch.Generator().manual_seed(3)
prompts = torch.randint(0, V, (8, 256), generator=gen).tolist()
stops = random_stop_ids(V, 256, torch.Generator().manual_seed(1))
rows = []
with aqn.noise(model, 1e-2, torch.Generator(dev).manual_seed(0)):
    # the numbers: each variant's early-stop rollout against SHARED_SUB = 1's (same seed)
    ref = None
    for sub in a.subs:
        release(model)
        setv(sub)
        r = decode.generate(model, prompts, n=8, max_new_tokens=64, temperature=1.0, seed=11)
        if ref is None:
            ref = r
        same = (r.tokens == ref.tokens).float().mean().item()
        first = (r.tokens[:, :8] == ref.tokens[:, :8]).float().mean().item()
        d = (r.logprobs[:, :8] - ref.logprobs[:, :8]).abs().max().item()
        print(f"  check variant {sub}: tokens equal {same:.3f} (first 8: {first:.3f}), max |dlogprob| first 8 {d:.2e}",
              flush=True)
        rows.append(dict(kind="check", sub=sub, same=same, first8=first, dlp8=d))
    for rnd in range(a.rounds):
        subs = a.subs if rnd % 2 == 0 else a.subs[::-1]
        for sub in subs:
            release(model)
            setv(sub)
            for b in a.batches:
                r = _bench_one(model, b // 8, 256, a.new_tokens, seed=b, n=8)
                rows.append(dict(kind="forced", sub=sub, round=rnd, batch=b, ms_step=r["ms_step"], kernels=r["kernels"]))
                print(f"  variant {sub}, round {rnd}, {b} rows: {r['ms_step']:.3f} ms a step", flush=True)
            for i in range(a.early):
                kw = dict(n=8, max_new_tokens=1024, temperature=PAIRED_TEMPERATURE, stop_ids=stops, seed=21 + i)
                decode.generate(model, prompts, **kw)  # compiles and captures
                torch.cuda.synchronize()
                t = time.perf_counter()
                r = decode.generate(model, prompts, **kw)
                torch.cuda.synchronize()
                s = time.perf_counter() - t
                rows.append(dict(kind="early", sub=sub, round=rnd, seed=21 + i, s=s, steps=r.stats["steps"],
                                 mean=float(r.lengths.float().mean()), longest=int(r.lengths.max())))
                print(f"  variant {sub}, round {rnd}, early-stop rollout seed {21 + i}: {s:.3f} s "
                      f"({r.stats['steps']} steps, mean length {float(r.lengths.float().mean()):.1f})", flush=True)
            release(model)
print("registers, spills (SHARED_SUB, ATTN_MAXNREG, shared):", regs)
print("| SHARED_SUB,ATTN_MAXNREG | " + " | ".join(f"{b} rows, ms a step" for b in a.batches) + " | early-stop rollout s |")
print("| --- |" + " --- |" * (len(a.batches) + 1))
for sub in a.subs:
    cells = [" / ".join(f"{r['ms_step']:.3f}" for r in rows if r["kind"] == "forced" and r["sub"] == sub and r["batch"] == b)
             for b in a.batches]
    cells.append(" / ".join(f"{r['s']:.3f}" for r in rows if r["kind"] == "early" and r["sub"] == sub))
    print(f"| {sub} | " + " | ".join(cells) + " |")
if a.json:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, copy=copy,
                   args=vars(a), rows=rows, regs={str(k): v for k, v in regs.items()}), open(a.json, "w"), indent=1)
