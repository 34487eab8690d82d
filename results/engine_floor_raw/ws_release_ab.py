"""Throwaway A/B (results/engine_floor_h100.md, its last section), with warp_release.patch applied: the
warp-specialized GEMMs with the ring's barrier ops as Gluon lowers them (plan.WARP_RELEASE 0: a warpgroup bar.sync
every k-step) and as each warp's own wait and release (1), on the 7B shapes the plan gives that kernel, at a few
row counts. Checks the outputs are equal bit for bit, then times each (µs a call, CUDA graph of rotated weight
copies) in alternating rounds.

    PYTHONPATH=. python results/engine_floor_raw/ws_release_ab.py 32 64 256 1024 --json ab.json
"""
import argparse, json
import torch, triton
from engine import plan as P
from engine.bench_gemm import QWEN7B_SHAPES, _graph_ms, _layer_for, _ours_calls, _run_one, copy_bandwidth

p = argparse.ArgumentParser()
p.add_argument("rows", type=int, nargs="*", default=[32, 64, 256, 1024])
p.add_argument("--json", default=None)
a = p.parse_args()
print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; "
      f"copy {copy_bandwidth():.2f} TB/s", flush=True)
out = []
for M in a.rows:
    for name, shape in QWEN7B_SHAPES.items():
        layer = _layer_for(shape)
        x = torch.randn(M, layer.in_features, device="cuda", dtype=torch.bfloat16)
        plan = P.plan_forward(M, layer.out_features, layer.in_features, x.dtype, x.device)
        if "STAGES" not in plan:
            continue
        ys = []
        for v in (0, 1):
            P.WARP_RELEASE = v
            ys.append(_run_one(shape, M, "fwd", None, x))
        us = {0: [], 1: []}
        for order in ((0, 1), (1, 0), (0, 1)):
            for v in order:
                P.WARP_RELEASE = v
                us[v].append(1000 * _graph_ms(_ours_calls(layer, M, None, "fwd", x)))
        row = dict(rows=M, layer=name, plan=plan, equal=torch.equal(*ys), us_gluon=us[0], us_warp=us[1])
        out.append(row)
        print(f"{name:8s} M={M:5d} equal={row['equal']}  gluon {min(us[0]):7.2f} µs  per warp {min(us[1]):7.2f} µs "
              f"({min(us[1]) / min(us[0]) - 1:+.1%});  rounds {[round(t, 2) for t in us[0]]} "
              f"{[round(t, 2) for t in us[1]]}", flush=True)
P.WARP_RELEASE = 0
if a.json:
    json.dump(out, open(a.json, "w"), indent=1)
