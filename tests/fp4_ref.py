"""Shared by the fp4_gemm tests (tests/test_fp4_gemm.py and tests/engine/): a float64 reference decode
written here, independently of fp4_gemm and nvfp4, and NVFP4 test weights.

What is asserted and why:
- Reference: x.double() @ W.double().T (+ bias), W decoded from the codes in float64 by a table
  written here (not by fp4_gemm), so a wrong nibble order or scale decode fails.
- Tolerance: relative Frobenius error ≤ 1e-2 for bf16/fp16 inputs. The Triton kernels build exact
  weights and accumulate in fp32, so their error is the final rounding to bf16 (~2e-3 RMS); the torch
  path also rounds W to bf16 first. For fp32 inputs ≤ 1e-5: only fp32 accumulation error remains
  (K ≤ 272 terms, observed ~1e-7), far above what a wrong element would give.
- Every output buffer the kernels allocate is poisoned with NaN (the `poisoned` fixture in conftest.py
  patches torch.empty), so an element a kernel forgot to write fails the comparison.
- Fresh random inputs per case (seeded by the case, so a failure reproduces).
"""
import os

import pytest
import torch

import fp4_gemm
import nvfp4

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
E2M1_SIGNED = E2M1 + [-v for v in E2M1]  # indexed by the 4-bit code (sign bit 3)

needs_triton = pytest.mark.skipif(
    not fp4_gemm.HAS_TRITON or (DEV.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="needs triton (interpreter on CPU: TRITON_INTERPRET=1 must be set before triton is imported)")
gpu_only = pytest.mark.skipif(DEV.type != "cuda", reason="needs a CUDA GPU")


def ref_weight(packed, scale, gs):
    """float64 (N, K) from the stored bytes, decoded independently of fp4_gemm/nvfp4."""
    p = packed.cpu().long()
    codes = torch.stack([p & 0xF, p >> 4], -1).reshape(p.shape[0], -1)  # (N, K), element 2i = low nibble
    table = torch.tensor(E2M1_SIGNED, dtype=torch.float64)
    vals = table[codes]
    s = scale.cpu().float().double().repeat_interleave(16, dim=1)  # (N, K)
    return vals * s / gs.cpu().double().reshape(-1, 1)


def make_q(n, k, per_row=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3  # rows of varied size
    w[:, :16] *= 1e-4  # a block whose scale is an E4M3 subnormal
    if per_row:  # rows quantized in groups, each with its own global scale (as after QuantLinear.concat)
        cut = [0, n // 3, n]
        qs = [nvfp4.quantize(w[a:b]) for a, b in zip(cut, cut[1:]) if b > a]
        gs = torch.cat([q.global_scale.expand(q.packed.shape[0]) for q in qs])
        q = nvfp4.NVFP4Tensor(torch.cat([q.packed for q in qs]), torch.cat([q.scale for q in qs]), gs.clone())
    else:
        q = nvfp4.quantize(w)
    return q.to(DEV)


def assert_replays_in_a_graph(fn, x):
    """fn(x) captured in a CUDA graph, x refilled, the graph replayed: its output equals fn on the new x.
    Returns that output."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fn(x)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(got, fn(x))
    return got


def rel_err(y, ref):
    return ((y.double().cpu() - ref).norm() / ref.norm()).item()


def tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


# (M, K, N): odd shapes, sampled from M {1, 3, 17} x K {16, 48, 272} x N {8, 40, 264}
SHAPES = [(1, 16, 8), (1, 272, 264), (3, 48, 40), (3, 272, 8), (17, 16, 264), (17, 272, 40), (17, 48, 8)]
MMA_SHAPES = [(1, 64, 8), (3, 320, 40), (17, 192, 264), (1, 576, 264), (9, 64, 40), (3, 256, 8)]


def run_case(M, K, N, dtype, bias, per_row, lead, seed, path, kernel=None):
    q = make_q(N, K, per_row, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(*lead, M, K, generator=g).to(dtype).to(DEV)
    b = (torch.randn(N, generator=g) * 0.5).to(dtype).to(DEV) if bias else None
    w = ref_weight(q.packed, q.scale, q.global_scale)
    ref = x.double().cpu() @ w.t() + (b.double().cpu() if bias else 0)
    with fp4_gemm.backend(path, kernel=kernel):
        y = fp4_gemm.fp4_linear(x, q, b)
    assert y.shape == (*lead, M, N) and y.dtype == dtype and y.device.type == DEV.type
    assert torch.isfinite(y).all(), "an output element was never written (NaN poison) or overflowed"
    return rel_err(y, ref)



def forward_case(kernel, case):
    """fp4_linear through `kernel` (pinned, on the Triton path) on a different sample of (shape, dtype,
    bias, per-row scale, leading dims) per case and kernel; the relative error against float64 and the
    tolerance it must meet."""
    g = torch.Generator().manual_seed(case * 7 + len(kernel))
    shapes = [s for s in SHAPES if kernel != "gemv" or s[0] <= 3]  # the interpreter runs a GEMV row per program
    M, K, N = shapes[(case + len(kernel)) % len(shapes)]
    if kernel == "mma":  # 16-bit x, K a multiple of 64 (tails of the 256-wide k-step included)
        M, K, N = MMA_SHAPES[case]
        dtype = [torch.bfloat16, torch.float16][case % 2]
    else:
        dtype = [torch.bfloat16, torch.float32][case % 2] if kernel != "dequant" or case % 2 == 0 else torch.bfloat16
    bias, per_row = bool(torch.randint(2, (), generator=g)), case % 3 == 1
    lead = [(), (2,), (2, 1)][case % 3]
    err = run_case(M, K, N, dtype, bias, per_row, lead, seed=case + 100 * len(kernel), path="triton", kernel=kernel)
    return err, tol(dtype), (M, K, N, dtype, bias, per_row)


def check_split_k(linear, plan, M, K, N):
    """One split-K case of a kernel launcher `linear(x, packed, scale_u8, global_scale, bias, plan)`:
    per-row global scales, a bias, bf16 x; within 1e-2 of float64 and bit-identical when called again
    (the partials' workspace and any tile counters are left ready for the next call)."""
    q = make_q(N, K, per_row=True, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEV)
    b = torch.randn(N, generator=g).to(torch.bfloat16).to(DEV)
    y = linear(x, q.packed, q.scale.view(torch.uint8), q.global_scale, b, plan)
    ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) <= 1e-2
    assert torch.equal(linear(x, q.packed, q.scale.view(torch.uint8), q.global_scale, b, plan), y)
