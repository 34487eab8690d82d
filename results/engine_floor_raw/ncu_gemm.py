"""Throwaway (results/engine_floor_h100.md, its last section): the decode's four fp4 GEMMs of the 7B shape, each
with the kernel and config the plan picks, at a few row counts, for Nsight Compute to see what each waits on.
Every (layer, rows) runs twice; the second launch is the one to read (the first compiles). The order is printed.

    PYTHONPATH=. ncu -k regex:"_mma_kernel|_wgmma" --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
        python results/engine_floor_raw/ncu_gemm.py 1 64
"""
import sys
import torch
from engine import plan as engine_plan
from engine.bench_gemm import QWEN7B_SHAPES, _layer_for, _run_one

rows = [int(a) for a in sys.argv[1:]] or [1, 64]
for M in rows:
    for name, shape in QWEN7B_SHAPES.items():
        layer = _layer_for(shape)
        x = torch.randn(M, layer.in_features, device="cuda", dtype=torch.bfloat16)
        p = engine_plan.plan_forward(M, layer.out_features, layer.in_features, x.dtype, x.device)
        for _ in range(2):
            _run_one(shape, M, "fwd", None, x)
        torch.cuda.synchronize()
        print(f"{name} M={M}: {p}", flush=True)
