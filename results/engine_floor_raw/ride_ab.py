"""Throwaway A/B (results/engine_floor_h100.md, "The LoRA A products riding in the plain wgmma kernel"): the
products riding in the plain wgmma kernel's launch (x in its K order from the op before) against the code
before (products on the second stream, x ordered by its own launch), in one process: "as is" forces
x_k_order's `side` off, which gives the kernel without side programs (the same TTGIR as before the patch);
with ride_qkv_o.patch, "ride" is the patch's rule (plan._side_fits: where a program runs at most two
k-steps) and "ride everywhere" lifts it (every plain wgmma plan). ms a decode step, forced length,
alternating rounds. Needs one of the ride patches applied:

    git apply results/engine_floor_raw/ride_qkv_o.patch
    PYTHONPATH=. python results/engine_floor_raw/ride_ab.py --batches 2 8 16 32 --json ab.json
"""
import argparse, json, sys, time
import torch, triton
import aqn, memory
from engine import decode, korder
from engine.bench_gemm import copy_bandwidth
from engine.bench_rollout import _add_lora, _bench_one, floor_ms, random_model, step_bytes
from model import qwen25_config
from rollout import release

p = argparse.ArgumentParser()
p.add_argument("--batches", type=int, nargs="+", default=[2, 4, 8, 16, 32])
p.add_argument("--samples", type=int, default=1)
p.add_argument("--rounds", type=int, default=2)
p.add_argument("--new-tokens", type=int, default=192)
p.add_argument("--size", default="7b")
p.add_argument("--json", default=None)
a = p.parse_args()
dev = torch.device("cuda")
copy = copy_bandwidth()
model = random_model(qwen25_config(a.size), "nvfp4", dev, seed=0)
_add_lora(model, 32)
kept = korder.x_k_order
def off(M, q, dtype, device, side=False):
    return kept(M, q, dtype, device, side=False)
variants = {"as is": off, "ride": kept}
from engine import plan as engine_plan
fits = getattr(engine_plan, "_side_fits", None)
if fits is not None:  # (ride_qkv_o.patch)
    variants["ride everywhere"] = kept
def patched(name):
    if fits is not None:
        engine_plan._side_fits = (lambda plan, K: plan["kernel"] == "wgmma" and "STAGES" not in plan) \
            if name == "ride everywhere" else fits
print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; copy {copy:.2f} TB/s; "
      f"{a.size} nvfp4 + LoRA r32, AQN 1e-2; prompt 256 ({a.samples} rows a prompt), {a.new_tokens} new tokens forced", flush=True)
rows = []
with aqn.noise(model, 1e-2, torch.Generator(dev).manual_seed(0)):
    for rnd in range(a.rounds):
        names = list(variants) if rnd % 2 == 0 else list(variants)[::-1]
        for name in names:
            release(model)
            decode.x_k_order = variants[name]
            patched(name)
            try:
                for b in a.batches:
                    n = min(a.samples, b)
                    r = _bench_one(model, b // n, 256, a.new_tokens, seed=b, n=n)
                    rows.append(dict(variant=name, round=rnd, batch=b, ms_step=r["ms_step"], kernels=r["kernels"],
                                     graphs=r["graphs"]))
                    print(f"  {name}, round {rnd}, {b} rows: {r['ms_step']:.3f} ms a step", flush=True)
            finally:
                decode.x_k_order = kept
                patched("as is")
            release(model)
print("| variant | " + " | ".join(f"{b} rows" for b in a.batches) + " |")
print("| --- |" + " --- |" * len(a.batches))
for name in variants:
    cells = [" / ".join(f"{r['ms_step']:.3f}" for r in rows if r["variant"] == name and r["batch"] == b) for b in a.batches]
    print(f"| {name} | " + " | ".join(cells) + " |")
mean = lambda v: sum(v) / len(v)
for name in list(variants)[1:]:
    print(f"| {name} - as is (means) | " + " | ".join(
        f"{mean([r['ms_step'] for r in rows if r['variant'] == name and r['batch'] == b]) - mean([r['ms_step'] for r in rows if r['variant'] == 'as is' and r['batch'] == b]):+.3f}"
        for b in a.batches) + " |")
if a.json:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, copy=copy,
                   args=vars(a), rows=rows), open(a.json, "w"), indent=1)
