"""engine/fp8.py on a GPU at the 7B MLP shapes, one layer at a time: the E4M3 weight and rows against the
torch forms, the error against the fp32 product, and where the time of a forward and a dX goes against
the bf16 path (8448 rows of x, a packed micro-batch). The table it gave: results/fp8_update.md.

    python experiments/fp8_probe.py
"""
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules, not this folder's scripts

import torch  # noqa: E402

import fp4_gemm  # noqa: E402
import nvfp4  # noqa: E402
from engine import fp8, plan  # noqa: E402

ROWS = 8448  # a packed 7B micro-batch: 256 prompt tokens + 8 completions of 1024
SHAPES = [(37888, 3584), (3584, 18944)]  # gate|up, down: (N, K)


def ms(fn, n=10):
    """Mean milliseconds of fn() over n calls, after one."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


def differ(a, b):
    """How many E4M3 bytes differ between two tensors (on any devices)."""
    return int((a.cpu().view(torch.uint8) != b.cpu().view(torch.uint8)).sum())


def probe(N, K, dev):
    q = nvfp4.quantize(torch.randn(N, K, device=dev) * 0.02)
    su8, gs = q.scale.view(torch.uint8), q.global_scale.float()
    w8, r = fp8.weight_e4m3(q.packed, su8, gs)
    w8_cpu, r_cpu = fp8.weight_e4m3(q.packed.cpu(), su8.cpu(), gs.cpu(), kernel=False)
    print(f"W {N}x{K}: GPU against CPU E4M3 bytes differ at {differ(w8, w8_cpu)} of {w8.numel()}; "
          f"r equal {torch.equal(r.cpu(), r_cpu)}")
    x = torch.randn(ROWS, K, device=dev, dtype=torch.bfloat16)
    x8, sx = fp8.rows_e4m3(x)
    x8_torch, sx_torch = fp8.rows_e4m3(x[:64], kernel=False)  # torch ops on the GPU
    print(f"   rows (64 of them): kernel against torch, bytes differ {differ(x8[:64], x8_torch)}, scales equal "
          f"{torch.equal(sx[:64], sx_torch)}")
    w = fp4_gemm.dequantize(q.packed, q.scale, q.global_scale, torch.float32)
    ref = x[:256].float() @ w.t()
    with fp4_gemm.fp8_tensor_cores():
        y8 = fp4_gemm.fp4_linear(x[:256], q)
    y16 = fp4_gemm.fp4_linear(x[:256], q)
    rel = lambda y: float((y.float() - ref).norm() / ref.norm())
    print(f"   relative error against the fp32 product: FP8 {rel(y8):.4f}, the bf16 path {rel(y16):.4f}")
    g = torch.randn(ROWS, N, device=dev, dtype=torch.bfloat16)
    w16 = w.to(torch.bfloat16)
    dequant = dict(kernel="dequant", DQ=(16, 256, 4))
    print(f"   ms: weight_e4m3 {ms(lambda: fp8.weight_e4m3(q.packed, su8, gs)):.3f}, rows x "
          f"{ms(lambda: fp8.rows_e4m3(x)):.3f}, rows dY*r {ms(lambda: fp8.rows_e4m3(g, r)):.3f}, torch's transpose "
          f"of W8 {ms(lambda: w8.t().contiguous()):.3f}, W8^T by the kernel "
          f"{ms(lambda: fp8.weight_e4m3(q.packed, su8, gs, transpose=True)):.3f}")
    print(f"   ms: scaled_mm forward {ms(lambda: fp8._mm(x8, sx, w8.t(), r[None], torch.bfloat16)):.3f}, with fast "
          f"accumulation {ms(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=r[None], out_dtype=torch.bfloat16, use_fast_accum=True)):.3f}, "
          f"bf16 mm {ms(lambda: x @ w16.t()):.3f}")
    print(f"   ms: fp8.linear {ms(lambda: fp8.linear(x, q.packed, su8, gs, None)):.3f}, dequant path "
          f"{ms(lambda: plan.linear(x, q.packed, su8, gs, None, plan=dequant)):.3f}; fp8.dx "
          f"{ms(lambda: fp8.dx(g, q.packed, su8, gs)):.3f}, dequant dX {ms(lambda: plan.dx(g, q.packed, su8, gs)):.3f}")


def main():
    if not torch.cuda.is_available():
        raise SystemExit("experiments/fp8_probe.py needs a CUDA GPU with FP8 tensor cores")
    torch.manual_seed(0)
    for N, K in SHAPES:
        probe(N, K, torch.device("cuda"))


if __name__ == "__main__":
    main()
