"""engine/fp8.py on a GPU at the 7B MLP shapes, one layer at a time: the E4M3 weight and rows against the
torch forms, the error against the fp32 product, and where the time of a forward and a dX goes against
the bf16 path (8448 rows of x, a packed micro-batch). The table it gave: results/fp8_update.md.

    python experiments/fp8_probe.py
"""
import os, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch
import fp4_gemm, nvfp4
from engine import fp8, plan

dev = torch.device("cuda")
torch.manual_seed(0)
for (N, K) in [(37888, 3584), (3584, 18944)]:
    w = torch.randn(N, K, device=dev) * 0.02
    q = nvfp4.quantize(w)
    su8 = q.scale.view(torch.uint8)
    gs = q.global_scale.float()
    w8, r = fp8.weight_e4m3(q.packed, su8, gs)
    w8c, rc = fp8.weight_e4m3(q.packed.cpu(), su8.cpu(), gs.cpu(), kernel=False)
    diff = (w8.cpu().view(torch.uint8) != w8c.view(torch.uint8))
    print(f"W {N}x{K}: gpu vs cpu E4M3 bytes differ at {int(diff.sum())} of {diff.numel()}; r equal {torch.equal(r.cpu(), rc)}")
    if diff.any():
        i = diff.nonzero()[:5]
        for a, b in i.tolist():
            print("   ", a, b, w8[a, b].float().item(), w8c[a, b].float().item())
    x = torch.randn(8448, K, device=dev, dtype=torch.bfloat16)
    x8, sx = fp8.rows_e4m3(x)
    x8c, sxc = fp8.rows_e4m3(x[:64].cpu(), kernel=False)
    print("   rows: bytes differ", int((x8[:64].cpu().view(torch.uint8) != x8c.view(torch.uint8)).sum()), "scales equal", torch.equal(sx[:64].cpu(), sxc))
    x8g, sxg = fp8.rows_e4m3(x[:64], kernel=False)  # torch ops on the GPU
    d = (x8[:64].view(torch.uint8) != x8g.view(torch.uint8))
    print("   rows kernel vs torch on the GPU: bytes differ", int(d.sum()), "cpu torch vs gpu torch", int((x8g.cpu().view(torch.uint8) != x8c.view(torch.uint8)).sum()))
    if d.any():
        a, b = d.nonzero()[0].tolist()
        v = x[a, b].float() * (448.0 / x[a].float().abs().max())
        print("     e.g.", v.item(), x8[a, b].float().item(), x8g[a, b].float().item())
    W = fp4_gemm.dequantize(q.packed, q.scale, q.global_scale, torch.float32)
    ref = (x[:256].float() @ W.t())
    with fp4_gemm.fp8_tensor_cores():
        y8 = fp4_gemm.fp4_linear(x[:256], q)
    y16 = fp4_gemm.fp4_linear(x[:256], q)
    rel = lambda a: float((a.float() - ref).norm() / ref.norm())
    print(f"   rel err vs fp32 ref: fp8 {rel(y8):.4f}, bf16 path {rel(y16):.4f}")

    def t(fn, n=10):
        fn(); torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / n * 1e3
    g = torch.randn(8448, N, device=dev, dtype=torch.bfloat16)
    print(f"   ms: weight_e4m3 {t(lambda: fp8.weight_e4m3(q.packed, su8, gs)):.3f}, rows x {t(lambda: fp8.rows_e4m3(x)):.3f}, "
          f"rows dY*r {t(lambda: fp8.rows_e4m3(g, r)):.3f}, transpose w8 {t(lambda: w8.t().contiguous()):.3f}, W8^T by the kernel {t(lambda: fp8.weight_e4m3(q.packed, su8, gs, transpose=True)):.3f}")
    print(f"   ms: scaled_mm fwd {t(lambda: fp8._mm(x8, sx, w8.t(), r[None], torch.bfloat16)):.3f}, "
          f"fast_accum {t(lambda: torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=r[None], out_dtype=torch.bfloat16, use_fast_accum=True)):.3f}, "
          f"bf16 mm {t(lambda: x @ W.to(torch.bfloat16).t()):.3f}")
    print(f"   ms: fp8.linear {t(lambda: fp8.linear(x, q.packed, su8, gs, None)):.3f}, dequant path {t(lambda: plan.linear(x, q.packed, su8, gs, None, plan=dict(kernel='dequant', DQ=(16, 256, 4)))):.3f}; "
          f"fp8.dx {t(lambda: fp8.dx(g, q.packed, su8, gs)):.3f}, dequant dx {t(lambda: plan.dx(g, q.packed, su8, gs)):.3f}")
