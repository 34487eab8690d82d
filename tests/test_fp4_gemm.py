"""fp4_gemm.py: the Triton NVFP4 kernels and the torch path against a float64 reference.

On a CPU-only machine the Triton kernels run in Triton's interpreter (fp4_gemm switches
TRITON_INTERPRET on before triton is first imported when no GPU is present; this file does the same
in case it is imported first). With a GPU the same tests run the compiled kernels, plus the checks
that only make sense there (the PTX decode against the plain one, CUDA graphs, torch.compile).

What is asserted and why:
- Reference: x.double() @ W.double().T (+ bias), W decoded from the codes in float64 by a table
  written here (not by fp4_gemm), so a wrong nibble order or scale decode fails.
- Tolerance: relative Frobenius error ≤ 1e-2 for bf16/fp16 inputs. The Triton kernels build exact
  weights and accumulate in fp32, so their error is the final rounding to bf16 (~2e-3 RMS); the torch
  path also rounds W to bf16 first. For fp32 inputs ≤ 1e-5: only fp32 accumulation error remains
  (K ≤ 272 terms, observed ~1e-7), far above what a wrong element would give.
- Every output buffer the kernels allocate is poisoned with NaN (torch.empty is patched for the
  test), so an element a kernel forgot to write fails the comparison.
- Fresh random inputs per case (seeded by the case, so a failure reproduces).
"""
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import fp4_gemm  # noqa: E402
import nvfp4  # noqa: E402

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


@pytest.fixture
def poisoned(monkeypatch):
    """Every float buffer created with torch.empty starts as NaN for the duration of the test."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


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


@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_path(M, K, N, dtype, poisoned):
    for bias, per_row, lead in [(False, False, ()), (True, True, (2,))]:
        err = run_case(M, K, N, dtype, bias, per_row, lead, seed=M * 1000 + K + N, path="torch")
        assert err <= tol(dtype), (bias, per_row, err)


@needs_triton
@pytest.mark.parametrize("kernel", ["mma", "gemv", "tiled", "dequant"])
@pytest.mark.parametrize("case", range(6))
def test_triton_forward(kernel, case, poisoned):
    # A different sample of (shape, dtype, bias, per-row scale, leading dims) per case and kernel.
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
    assert err <= tol(dtype), (M, K, N, dtype, bias, per_row, err)


@needs_triton
@pytest.mark.parametrize("kernel,plan", [
    ("mma", dict(kernel="mma", ROW_TILES=2, num_warps=1, SPLIT_K=2)),
    ("gemv", dict(kernel="gemv", BLOCK_N=16, BLOCK_K=32, SPLIT_K=3)),
    ("tiled", dict(kernel="tiled", BLOCK_M=16, BLOCK_N=16, BLOCK_K=32, GROUP_M=2, SPLIT_K=4)),
    ("tiled", dict(kernel="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, SPLIT_K=2)),
    # a deep split as the GPU plans for 17-64 rows use: 8 asked, 5 left after rounding to whole K blocks
    ("tiled", dict(kernel="tiled", BLOCK_M=32, BLOCK_N=16, BLOCK_K=32, GROUP_M=8, SPLIT_K=8)),
])
def test_split_k(kernel, plan, poisoned):
    """Split-K: fp32 partials in a workspace (poisoned too) summed by the reduce kernel (the mma kernel:
    by the program that finishes a tile last), with uneven splits (K = 272 or 832 is no multiple of the
    split's K range) and tiles that overhang N and M."""
    M, K, N = (2, 272, 40) if kernel == "gemv" else (17, 272, 40) if kernel == "tiled" else (9, 832, 40)
    q = make_q(N, K, per_row=True, seed=5)
    g = torch.Generator().manual_seed(6)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEV)
    b = torch.randn(N, generator=g).to(torch.bfloat16).to(DEV)
    y = fp4_gemm.triton_linear(x, q.packed, q.scale.view(torch.uint8), q.global_scale, b, plan)
    ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) <= 1e-2
    # deterministic, and the mma kernel's split-K counters are back at zero for the next call
    assert torch.equal(fp4_gemm.triton_linear(x, q.packed, q.scale.view(torch.uint8), q.global_scale, b, plan), y)


@needs_triton
@pytest.mark.parametrize("M,K,SR", [(1, 576, 40), (5, 48, 16), (8, 2560, 96), (17, 300, 21)])
def test_small_linear_against_float64(M, K, SR, poisoned):
    """The decode LoRA-A product (K split, the last program of a tile sums the partials) at odd shapes:
    rows past M, columns past SR, a K tail, one chunk (K = 48) and several (10 for K = 2560), a row tile
    past 16; the ticket counters back at zero and a second call bit-identical (a fixed order)."""
    g = torch.Generator().manual_seed(M * K + SR)
    x, A = torch.randn(M, K, generator=g).to(DEV), torch.randn(SR, K, generator=g).to(DEV)
    got = fp4_gemm.small_linear(x, A)
    ref = x.double().cpu() @ A.double().cpu().t()
    assert torch.allclose(got.double().cpu(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(fp4_gemm.small_linear(x, A), got)
    assert not fp4_gemm._locks(x.device).any()


@needs_triton
@pytest.mark.parametrize("M,K,N,SR,plan", [
    (1, 64, 40, 16, dict(kernel="mma", ROW_TILES=1, num_warps=2, SPLIT_K=1)),
    # the weight split in 2, the side's 3 chunks spread over 2 columns x 2 splits (one chunk empty)
    (3, 576, 72, 40, dict(kernel="mma", ROW_TILES=1, num_warps=2, SPLIT_K=2)),
    (8, 320, 264, 5, dict(kernel="mma", ROW_TILES=2, num_warps=1, SPLIT_K=2)),
    # no mma, or more rows than one x tile of it: the side falls back to a launch of its own
    (5, 48, 40, 21, dict(kernel="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, SPLIT_K=1)),
    (9, 320, 40, 16, dict(kernel="mma", ROW_TILES=1, num_warps=2, SPLIT_K=2)),
])
def test_side_product_rides_along(M, K, N, SR, plan, poisoned):
    """fp4_linear_side: the side's programs inside the mma launch leave y exactly as the plain launch
    makes it, x @ side^T matches float64, the counters return to zero, and a second call is
    bit-identical, also with the first codes loaded before the launch wait (decode's constant_weight)."""
    q = make_q(N, K, per_row=True, seed=M + K + SR)
    g = torch.Generator().manual_seed(SR)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEV)
    side = (torch.randn(SR, K, generator=g) * 0.1).to(torch.bfloat16).to(DEV)
    b = torch.randn(N, generator=g).to(torch.bfloat16).to(DEV)
    args = (x, q.packed, q.scale.view(torch.uint8), q.global_scale, b, plan)
    y, a = fp4_gemm.triton_linear(*args, side=side)
    assert torch.equal(y, fp4_gemm.triton_linear(*args))
    ref = x.double().cpu() @ side.double().cpu().t()
    assert a.shape == (M, SR) and a.dtype == x.dtype and rel_err(a, ref) <= 1e-2
    y2, a2 = fp4_gemm.triton_linear(*args, side=side, constant_weight=True)
    assert torch.equal(y2, y) and torch.equal(a2, a) and not fp4_gemm._locks(x.device).any()
    # the public entry, on whichever path this machine runs
    y3, a3 = fp4_gemm.fp4_linear_side(x, q, b, side)
    assert rel_err(y3, x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()) <= 1e-2
    assert rel_err(a3, ref) <= 1e-2
    with pytest.raises(ValueError):
        fp4_gemm.fp4_linear_side(x, q, b, side.float())


@pytest.mark.parametrize("path,kernel", [("torch", None)] + ([("triton", "tiled"), ("triton", "dequant")]
                                                          if fp4_gemm.HAS_TRITON else []))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_backward_dx_only(path, kernel, dtype, poisoned):
    """dX = dY @ W (float64 reference); packed weight, scales and global scale get no gradient; a
    trainable bias gets dY summed over the leading dims."""
    if path == "triton" and DEV.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no interpreter")
    M, K, N = 17, 48, 40
    q = make_q(N, K, per_row=(dtype == torch.float32), seed=11)
    layer = fp4_gemm.QuantLinear(K, N, bias=True, dtype=dtype, device=DEV, per_row_scale=q.global_scale.numel() > 1)
    layer.weight_packed.copy_(q.packed)
    layer.weight_scale.copy_(q.scale)
    layer.weight_global_scale.copy_(q.global_scale)
    layer.bias.requires_grad_(True)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(2, M, K, generator=g).to(dtype).to(DEV).requires_grad_(True)
    dy = torch.randn(2, M, N, generator=g).to(dtype).to(DEV)
    with fp4_gemm.backend(path, kernel=kernel):
        layer(x).backward(dy)
    w = ref_weight(q.packed, q.scale, q.global_scale)
    assert x.grad.dtype == dtype and torch.isfinite(x.grad).all()
    assert rel_err(x.grad, dy.double().cpu() @ w) <= tol(dtype)
    assert rel_err(layer.bias.grad, dy.double().cpu().sum((0, 1))) <= tol(dtype)
    assert all(not b.requires_grad for b in layer.buffers())


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequant_kernel_is_bit_identical(dtype, poisoned):
    """The dequant path's Triton kernel reproduces nvfp4.dequantize (through fp4_gemm.dequantize), per-tensor
    and per-row scales, bit for bit: same float32 arithmetic, one rounding. (Triton's interpreter rounds
    float32 → bf16 by truncation, so on CPU bf16 may differ by one bf16 step.)"""
    for per_row in (False, True):
        q = make_q(40, 272, per_row, seed=21 + per_row)
        got = fp4_gemm.dequantize_triton(q.packed, q.scale.view(torch.uint8), q.global_scale, dtype).cpu()
        want = fp4_gemm.dequantize(q.packed, q.scale, q.global_scale, dtype).cpu()
        if dtype == torch.float32 or DEV.type == "cuda":
            assert torch.equal(got, want)
        else:
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
        exact = ref_weight(q.packed, q.scale, q.global_scale)  # float32 scale / g is the only rounding
        assert torch.allclose(fp4_gemm.dequantize(q.packed, q.scale, q.global_scale, torch.float64).cpu(), exact,
                              rtol=2**-23, atol=0)


def test_concat_is_exact_on_the_torch_path():
    """QuantLinear.concat (q/k/v, gate/up fusion) keeps each part's global scale per row, so the
    fused output equals the separate outputs bit for bit."""
    torch.manual_seed(31)
    K = 48
    parts = [torch.nn.Linear(K, n, bias=b, dtype=torch.bfloat16) for n, b in ((24, True), (8, False), (16, True))]
    for lin in parts:
        lin.weight.data *= torch.rand(()) * 10  # different amax → different global scales
    qs = [fp4_gemm.QuantLinear.from_linear(lin) for lin in parts]
    fused = fp4_gemm.QuantLinear.concat(qs)
    assert fused.weight_global_scale.shape == (48,) and fused.out_features == 24 + 8 + 16
    x = torch.randn(3, 5, K, dtype=torch.bfloat16)
    with fp4_gemm.backend("torch"):
        want = torch.cat([q(x) for q in qs], -1)
        got = fused(x)
    assert torch.equal(got, want)
    assert torch.equal(fused.dequantized_weight(), torch.cat([q.dequantized_weight() for q in qs]))


@needs_triton
def test_concat_through_triton(poisoned):
    parts = [fp4_gemm.QuantLinear(272, n, bias=False, device=DEV) for n in (24, 40)]
    for i, p in enumerate(parts):
        q = make_q(p.out_features, 272, seed=40 + i)
        p.weight_packed.copy_(q.packed)
        p.weight_scale.copy_(q.scale)
        p.weight_global_scale.copy_(q.global_scale * (1 + 3 * i))
    fused = fp4_gemm.QuantLinear.concat(parts)
    x = torch.randn(3, 272, dtype=torch.bfloat16, device=DEV)
    with fp4_gemm.backend("triton"):
        got = fused(x)
    w = torch.cat([ref_weight(p.weight_packed, p.weight_scale, p.weight_global_scale) for p in parts])
    assert rel_err(got, x.double().cpu() @ w.t()) <= 1e-2


def test_backend_choice(monkeypatch):
    """auto: torch on CPU tensors, Triton on CUDA ones; forcing either works; bad names are refused."""
    called = []
    monkeypatch.setattr(fp4_gemm, "triton_linear", lambda *a, **k: called.append("triton") or torch.zeros(1, 8))
    q = make_q(8, 16, seed=50)
    x = torch.randn(1, 16, device=DEV)
    fp4_gemm.fp4_linear(x, q)
    assert called == (["triton"] if DEV.type == "cuda" and fp4_gemm.HAS_TRITON else [])
    with fp4_gemm.backend("torch"):
        fp4_gemm.fp4_linear(x, q)
    assert len(called) == (1 if DEV.type == "cuda" and fp4_gemm.HAS_TRITON else 0)
    if fp4_gemm.HAS_TRITON:
        with fp4_gemm.backend("triton"):
            fp4_gemm.fp4_linear(x, q)
        assert called[-1] == "triton"
    with pytest.raises(ValueError):
        fp4_gemm.set_backend("cutlass")
    assert fp4_gemm._choice["backend"] in fp4_gemm.BACKENDS
    # the environment variable is checked as strictly, at import
    import subprocess
    env = dict(os.environ, QERL_FP4_BACKEND="tritn")
    r = subprocess.run([sys.executable, "-c", "import fp4_gemm"], cwd=Path(fp4_gemm.__file__).parent, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "QERL_FP4_BACKEND='tritn'" in r.stderr


def test_shape_errors():
    q = make_q(8, 32, seed=60)
    with pytest.raises(ValueError):
        fp4_gemm.fp4_linear(torch.randn(2, 48, device=DEV), q)
    with pytest.raises(ValueError):
        fp4_gemm.QuantLinear(30, 8)


def test_opcheck_and_compile_trace():
    """The custom op's fake (meta) implementation and autograd registration are consistent, and
    torch.compile traces a layer as one opaque op without graph breaks. (opcheck's schema test
    perturbs inputs arithmetically, which float8 tensors do not support on CPU.)"""
    q = make_q(24, 48, seed=70)
    x = torch.randn(5, 48, dtype=torch.float32, device=DEV, requires_grad=True)
    b = torch.randn(24, device=DEV)
    with fp4_gemm.backend("torch"):
        torch.library.opcheck(torch.ops.qerl.fp4_linear.default, (x, q.packed, q.scale, q.global_scale, b),
                              test_utils=("test_autograd_registration", "test_faketensor"))
        f = torch.compile(lambda t: fp4_gemm.fp4_linear(t, q, b).square().sum(), backend="aot_eager", fullgraph=True)
        f(x).backward()
    ref = x.detach().double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()
    assert rel_err(x.grad, (2 * ref) @ ref_weight(q.packed, q.scale, q.global_scale)) < 1e-5


@gpu_only
def test_gpu_ptx_decode_matches_plain_decode():
    """The PTX decode (GPU) builds the same exact weights as the plain Triton decode: the tiled
    kernel's outputs agree bit for bit, the GEMV (different summation order) to fp32 rounding."""
    q = make_q(264, 272, per_row=True, seed=80)
    x = torch.randn(17, 272, dtype=torch.bfloat16, device=DEV)
    args = (q.packed, q.scale.view(torch.uint8), q.global_scale, None)
    for bn, bk in ((32, 64), (64, 256)):
        plan = dict(kernel="tiled", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, SPLIT_K=1, num_warps=4,
                    num_stages=2)
        fast = fp4_gemm.triton_linear(x, *args, plan)
        slow = fp4_gemm.triton_linear(x, *args, dict(plan, asm=False))
        assert torch.equal(fast, slow)
    plan = dict(kernel="gemv", BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, num_warps=4)
    fast = fp4_gemm.triton_linear(x[:1].float(), *args, plan)
    slow = fp4_gemm.triton_linear(x[:1].float(), *args, dict(plan, asm=False))
    assert rel_err(fast, slow.double().cpu()) < 1e-6


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mma_ptx_matches_its_model(dtype):
    """The mma kernel's PTX block (decode + mma.sync, lanes exchanging nothing) against the plain-Triton
    model of it (the path the CPU tests run) and the float64 reference, at shapes with a K tail, token
    tiles, split-K, rows past N and two row tiles a warp (which the old axis order spread over lanes)."""
    for M, K, N, split, rt in ((1, 3584, 200, 1, 1), (8, 1088, 136, 2, 1), (13, 576, 72, 3, 1), (8, 1088, 264, 2, 2),
                               (5, 576, 200, 1, 2)):
        q = make_q(N, K, per_row=True, seed=M + K)
        x = torch.randn(M, K, dtype=dtype, device=DEV)
        args = (q.packed, q.scale.view(torch.uint8), q.global_scale, None)
        plan = dict(kernel="mma", ROW_TILES=rt, num_warps=4, SPLIT_K=split)
        fast = fp4_gemm.triton_linear(x, *args, plan)
        slow = fp4_gemm.triton_linear(x, *args, dict(plan, asm=False))
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t()
        assert rel_err(fast, slow.double().cpu()) < 2e-3  # fp32 sums in another order, then 16-bit rounding
        assert rel_err(fast, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3)


hopper_gluon = pytest.mark.skipif(
    not (fp4_gemm.HAS_GLUON and DEV.type == "cuda" and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs triton with Gluon and a Hopper GPU (sm_90)")


@hopper_gluon
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_wgmma_against_float64(dtype, poisoned):
    """The wgmma kernel (decoded weights as wgmma's register operand, x permuted along K in shared
    memory) against float64: token tiles of 16 to 128 rows that overhang M, rows past N, k-steps of 128
    and 256, uneven split-K (8 asked of 28 k-steps: 7 splits of 4; 3 of 3 k-steps), bias, per-row
    global scales; deterministic, with the split-K counters back at zero; and replayed inside a CUDA
    graph."""
    for M, K, N, bt, bk, split, bias, per_row in ((9, 128, 40, 16, 128, 1, True, True),
                                                  (17, 384, 264, 32, 128, 3, False, True),
                                                  (64, 1152, 200, 64, 128, 4, True, False),
                                                  (100, 1536, 136, 64, 256, 2, True, True),
                                                  (40, 512, 300, 64, 256, 1, False, True),
                                                  (150, 768, 520, 128, 128, 1, True, True),
                                                  (130, 3584, 72, 64, 128, 8, False, False)):
        q = make_q(N, K, per_row, seed=M + K)
        x = torch.randn(M, K, dtype=dtype, device=DEV)
        b = torch.randn(N, dtype=dtype, device=DEV) if bias else None
        args = (q.packed, q.scale.view(torch.uint8), q.global_scale, b)
        plan = dict(kernel="wgmma", BT=bt, BLOCK_K=bk, SPLIT_K=split)
        y = fp4_gemm.triton_linear(x, *args, plan)
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + (b.double().cpu() if bias else 0)
        assert torch.isfinite(y).all(), (M, K, N)
        assert rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3), (M, K, N, rel_err(y, ref))
        assert torch.equal(fp4_gemm.triton_linear(x, *args, plan), y)
    assert fp4_gemm.plan_forward(24, 37888, 3584, torch.bfloat16, DEV)["kernel"] == "wgmma"
    assert_replays_in_a_graph(lambda x: fp4_gemm.triton_linear(x, *args, plan), x)


@hopper_gluon
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_wgmma_ws_against_float64(dtype, poisoned):
    """The warp-specialized wgmma kernel (a producer warp filling a ring by TMA; STAGES in the plan)
    against float64: 8-row tiles from one row of x, rings shallower and deeper than the k-steps, uneven
    split-K, two or three consumer warpgroups (three: 192 weight rows a tile) with rows past N, bias,
    per-row global scales; equal bit for bit to the kernel without the producer on the same tiles (same
    slices, same order), and deterministic, with the counters back at zero; codes that TMA cannot read
    fall back to that kernel; replayed inside a CUDA graph. Then plans that split only the tiles after
    WHOLE, persistent ones, and persistent ones sharing out k-steps (stream-K)."""
    for M, K, N, bt, split, stages, nwg, bias, per_row in (
            (1, 512, 200, 8, 1, 4, 1, True, True), (5, 2304, 72, 8, 4, 2, 1, False, True),
            (8, 1536, 136, 8, 2, 6, 2, True, False), (9, 256, 40, 16, 1, 4, 1, True, True),
            (17, 2816, 264, 32, 5, 2, 1, False, True), (64, 1536, 200, 64, 4, 4, 2, True, False),
            (100, 2048, 520, 128, 2, 2, 1, True, True), (130, 3584, 72, 64, 8, 2, 2, False, False),
            (64, 2304, 520, 64, 3, 2, 3, True, True), (20, 1024, 300, 32, 1, 2, 3, False, False),
            (70, 1536, 600, 128, 2, 2, 3, True, False)):
        q = make_q(N, K, per_row, seed=M + K)
        x = torch.randn(M, K, dtype=dtype, device=DEV)
        b = torch.randn(N, dtype=dtype, device=DEV) if bias else None
        args = (q.packed, q.scale.view(torch.uint8), q.global_scale, b)
        tiles = dict(kernel="wgmma", BT=bt, BLOCK_K=256, SPLIT_K=split)
        plan = dict(tiles, STAGES=stages, NWG=nwg)
        y = fp4_gemm.triton_linear(x, *args, plan)
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + (b.double().cpu() if bias else 0)
        assert torch.isfinite(y).all(), (M, K, N)
        assert rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3), (M, K, N, rel_err(y, ref))
        assert torch.equal(fp4_gemm.triton_linear(x, *args, plan), y)
        if bt >= 16:
            assert torch.equal(fp4_gemm.triton_linear(x, *args, tiles), y), (M, K, N)
        assert not fp4_gemm._locks(x.device).any()
    # codes at an odd offset: not TMA-aligned, so the same tiles without the producer
    wide = make_q(N, K + 256, per_row, seed=3)
    packed, scale = wide.packed[:, 8:8 + K // 2], wide.scale.view(torch.uint8)[:, 1:1 + K // 16]
    assert not fp4_gemm._tma_fits(packed, scale)
    got = fp4_gemm.triton_linear(x, packed, scale, wide.global_scale, None, plan)
    assert torch.equal(got, fp4_gemm.triton_linear(x, packed, scale, wide.global_scale, None, tiles))
    assert_replays_in_a_graph(lambda x: fp4_gemm.triton_linear(x, *args, plan), x)
    # the last wave's tiles split (WHOLE), several tiles of x: the tiles before WHOLE equal the unsplit
    # plan's bit for bit, the others the split plan's (same slices, same order)
    for M, K, N, bt, nwg, whole, split, bias in ((100, 1536, 520, 64, 1, 5, 3, True),
                                                 (130, 2048, 1000, 128, 2, 2, 4, False),
                                                 (64, 1536, 1100, 64, 3, 2, 3, True)):
        q = make_q(N, K, True, seed=M + K)
        x = torch.randn(M, K, dtype=dtype, device=DEV)
        b = torch.randn(N, dtype=dtype, device=DEV) if bias else None
        args = (q.packed, q.scale.view(torch.uint8), q.global_scale, b)
        plan = dict(kernel="wgmma", BT=bt, BLOCK_K=256, SPLIT_K=split, STAGES=2, NWG=nwg)
        y = fp4_gemm.triton_linear(x, *args, dict(plan, WHOLE=whole))
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + (b.double().cpu() if bias else 0)
        assert rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3), (M, K, N, rel_err(y, ref))
        r = 64 * nwg * whole
        assert torch.equal(y[:, :r], fp4_gemm.triton_linear(x, *args, dict(plan, SPLIT_K=1))[:, :r])
        assert torch.equal(y[:, r:], fp4_gemm.triton_linear(x, *args, plan)[:, r:])
        assert not fp4_gemm._locks(x.device).any()
    # persistent programs (PERSIST): 8 x 33 tiles for 132 or fewer programs, groups of tiles of x that do not
    # divide 8, rows past M and N: every tile written, equal bit for bit to one program a tile
    M, K, N = 1000, 512, 4200
    q = make_q(N, K, True, seed=7)
    x = torch.randn(M, K, dtype=dtype, device=DEV)
    b = torch.randn(N, dtype=dtype, device=DEV)
    args = (q.packed, q.scale.view(torch.uint8), q.global_scale, b)
    plan = dict(kernel="wgmma", BT=128, BLOCK_K=256, SPLIT_K=1, STAGES=2, NWG=2)
    ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()
    for group in (3, 16):
        y = fp4_gemm.triton_linear(x, *args, dict(plan, PERSIST=True, GROUP_M=group))
        assert torch.isfinite(y).all() and rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3)
        assert torch.equal(y, fp4_gemm.triton_linear(x, *args, plan)), group
    assert fp4_gemm.plan_forward(1024, 37888, 3584, dtype, x.device).get("PERSIST")  # gate/up's plan there
    # stream-K (STREAM): tiles shared by 7 programs (16 tiles of 14 k-steps, 2 k-steps a program), by two (99
    # tiles of 4, 3 a program), whole tiles in turn and then shared ones (320 tiles: 132 whole, then 188 of 2
    # k-steps, 3 a program), 64-row tiles with one consumer warpgroup and more places than k-steps (48 tiles of
    # 4 for 264 programs: some take none), three consumer warpgroups (11 tiles of 14 k-steps, 2 a program; 33
    # tiles of 4, 1 a program): every partial summed once, in the same order each call
    for M, K, N, bt, nwg in ((200, 3584, 1000, 128, 2), (300, 1024, 4200, 128, 2), (1000, 512, 5000, 128, 2),
                             (150, 1024, 1000, 64, 1), (64, 3584, 2000, 64, 3), (300, 1024, 2000, 128, 3)):
        q = make_q(N, K, True, seed=M + N)
        x = torch.randn(M, K, dtype=dtype, device=DEV)
        b = torch.randn(N, dtype=dtype, device=DEV)
        args = (q.packed, q.scale.view(torch.uint8), q.global_scale, b)
        stream = dict(plan, BT=bt, NWG=nwg, PERSIST=True, STREAM=True, GROUP_M=16)
        tiles = -(-M // bt) * -(-N // (64 * nwg))
        _, per, slots = fp4_gemm._stream_k(tiles, K // 256, fp4_gemm._ws_places(stream, x.device))
        assert slots > 1 and per % (K // 256) != 0, (M, K, N, per)  # (some tiles shared, as meant)
        y = fp4_gemm.triton_linear(x, *args, stream)
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()
        assert torch.isfinite(y).all() and rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3), (M, K, N)
        assert torch.equal(fp4_gemm.triton_linear(x, *args, stream), y)
        assert not fp4_gemm._locks(x.device).any()


@gpu_only
def test_gpu_cuda_graph_and_compile():
    """A decode-sized call replays inside a CUDA graph and runs under torch.compile with the same result."""
    layer = fp4_gemm.QuantLinear.from_linear(torch.nn.Linear(512, 384, dtype=torch.bfloat16, device=DEV))
    x = torch.randn(4, 512, dtype=torch.bfloat16, device=DEV)
    want = layer(x)  # also compiles the kernel before capture
    got = assert_replays_in_a_graph(layer, x)
    compiled = torch.compile(layer, fullgraph=True)
    assert torch.equal(compiled(x), layer(x))
    assert not torch.equal(want, got)  # the replay really recomputed from the new x


def test_hopper_plans_are_configs_the_sweep_tries(monkeypatch):
    """plan_forward's table on an H200 only ever picks configs that `--tune` times (so each was measured
    and is checked by the GPU tests' kernels), for the Qwen2.5 7B, 14B and 32B layer shapes: the
    mma at one row, the plain wgmma kernel from 2 to 32 rows, the warp-specialized one from 33 to 256
    (gate/up from 17, with three consumer warpgroups), with k-steps of 256, and its persistent stream-K
    form for gate/up from 129 to 2048 rows and for down from 257 to 512 (three warpgroups); down's splits
    fit in one wave (14B and 32B: 3, not 4; stream-K with two warpgroups at 129-256 rows); dequant +
    cuBLAS for the rest above 256."""
    monkeypatch.setattr(fp4_gemm, "_is_hopper", lambda device: True)
    monkeypatch.setattr(fp4_gemm, "HAS_GLUON", True)
    monkeypatch.setattr(fp4_gemm, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")  # plan_forward's GPU table; nothing runs on a GPU here
    shapes = [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584),  # 7B: K, N of q/k/v, o, gate/up, down
              (5120, 7168), (5120, 5120), (5120, 27648), (13824, 5120),  # 14B
              (5120, 7168), (5120, 5120), (5120, 55296), (27648, 5120)]  # 32B
    for M in (1, 2, 4, 8, 9, 16, 17, 32, 33, 64, 65, 100, 128, 129, 200, 256, 257, 512, 513, 1024, 2048, 2049, 4096):
        for K, N in shapes:
            plan = fp4_gemm.plan_forward(M, N, K, torch.bfloat16, cuda)
            assert plan in fp4_gemm._candidates(M, N, K, "fwd"), (M, N, K, plan)
            wide, long = N >= 16384, K >= 8192  # gate/up, down
            want = ("mma" if M == 1 else "wgmma" if M <= 256 or (wide and M <= 2048) or (long and M <= 512)
                    else "dequant")
            assert plan["kernel"] == want, (M, N, K, plan)
            assert ("STAGES" in plan) == ((32 < M or (wide and 16 < M)) and want == "wgmma"), (M, N, K, plan)
            # 7B down's weight tiles split 4 or 2 ways fit in one wave (56 x 4 of 64 rows for 264 places at 33-64
            # rows of x, 28 x 4 or x 2 of 128 for 132 above); 14B's and 32B's (80 or 40) split 3 ways up to 128
            # rows, and at 129-256, where 80 tiles leave no room for 2, share out k-steps
            stream = want == "wgmma" and (M > 256 or (wide and M > 128) or (long and M > 128 and N > 3584))
            assert plan.get("PERSIST", False) == plan.get("STREAM", False) == stream, (M, N, K, plan)
            if long and 32 < M <= 128:
                assert plan["SPLIT_K"] == (4 if N == 3584 else 3), (M, N, K, plan)
            if "STAGES" in plan:
                three = (wide and M > 16) or (long and M > 256)
                assert plan["NWG"] == 3 if three else plan["NWG"] in (1, 2), (M, N, K, plan)
            assert "STAGES" not in plan or plan["BLOCK_K"] == 256


def test_stream_k_shares_every_k_step_once():
    """_stream_k's share-out, walked as the persistent kernel walks it: whole tiles p, p + places, .. below
    the first stream-K tile, then k-steps p · per .. of the rest, tile after tile. Every k-step of every
    tile is taken by exactly one program, and the programs sharing a tile (first = r · n // per on) are
    at most `slots`, as many fp32 partials as the host allocates. Below two waves every tile is shared
    out; above, one to two waves' worth."""
    for tiles, n, places in ((16, 14, 132), (99, 4, 132), (320, 2, 132), (48, 4, 264), (264, 74, 132),
                             (224, 74, 132), (72, 14, 132), (2368, 14, 132), (1, 1, 132), (5, 3, 4)):
        first, per, slots = fp4_gemm._stream_k(tiles, n, places)
        rest = tiles - first
        assert first % places == 0 and (rest == tiles if tiles < 2 * places else places <= rest < 2 * places)
        taken = {}
        for p in range(places):
            for t in range(p, first, places):
                taken.update({(t, k): taken.get((t, k), []) + [p] for k in range(n)})
            u_lo, u_hi = p * per, min(p * per + per, (tiles - first) * n)
            for r in range(u_lo // n, (u_hi + n - 1) // n):
                for k in range(max(u_lo - r * n, 0), min(u_hi - r * n, n)):
                    taken[first + r, k] = taken.get((first + r, k), []) + [p]
        assert sorted(taken) == [(t, k) for t in range(tiles) for k in range(n)], (tiles, n, places)
        assert all(len(ps) == 1 for ps in taken.values())
        for r in range(tiles - first):
            sharing = sorted({taken[first + r, k][0] for k in range(n)})
            lo, hi = r * n // per, ((r + 1) * n - 1) // per  # the consumer's first and last program of tile r
            assert sharing == list(range(lo, hi + 1)) and len(sharing) <= slots, (tiles, n, places, r)


def test_last_wave_split_fills_the_gpu(monkeypatch):
    """An unsplit warp-specialized plan with more tiles than one wave of programs keeps the full waves'
    tiles whole and splits the rest about as many ways as one wave has places for them; with fewer
    tiles than a wave, or whole waves, nothing changes. The same wave sets q/k/v's three splits at
    33-64 rows. (132 SMs as an H200; two programs an SM hold 64-row tiles of x with one consumer
    warpgroup, one holds 128-row tiles with two.)"""
    monkeypatch.setattr(fp4_gemm, "_sm_count", lambda device: 132)
    monkeypatch.setattr(fp4_gemm, "_is_hopper", lambda device: True)
    monkeypatch.setattr(fp4_gemm, "HAS_GLUON", True)
    cuda = torch.device("cuda")  # nothing runs on a GPU here
    one = dict(kernel="wgmma", BT=64, BLOCK_K=256, SPLIT_K=1, STAGES=2, NWG=1)
    two = dict(one, BT=128, NWG=2)
    assert fp4_gemm._ws_programs_per_sm(one) == 2 and fp4_gemm._ws_programs_per_sm(two) == 1
    # gate/up (37888 rows, K 3584 = 14 k-steps): 592 tiles of 64 = 2 waves of 264 + 64 split 4 ways
    assert fp4_gemm._last_wave_split(one, 64, 37888, 3584, cuda) == dict(WHOLE=528, SPLIT_K=4)
    # 296 tiles of 128 at 128 rows: 264 + 32 x 4; at 256 rows (two tiles of x) 2 x 264 + 64 x 2
    assert fp4_gemm._last_wave_split(two, 128, 37888, 3584, cuda) == dict(WHOLE=264, SPLIT_K=4)
    assert fp4_gemm._last_wave_split(two, 256, 37888, 3584, cuda) == dict(WHOLE=264, SPLIT_K=2)
    # no more splits than k-steps: 2 k-steps, 265 tiles
    assert fp4_gemm._last_wave_split(one, 64, 265 * 64, 512, cuda) == dict(WHOLE=264, SPLIT_K=2)
    assert fp4_gemm._last_wave_split(one, 64, 264 * 64, 3584, cuda) == {}  # exactly one wave
    assert fp4_gemm._last_wave_split(one, 64, 200 * 64, 3584, cuda) == {}  # less than one
    assert fp4_gemm._last_wave_split(one, 64, 527 * 64, 3584, cuda) == {}  # 263 left: no room to split
    # q/k/v (72 tiles) splits three ways at 33-64 rows, where that fits one wave; o (56 tiles, N = K) two
    for M in (33, 64):
        assert fp4_gemm.plan_forward(M, 4608, 3584, torch.bfloat16, cuda)["SPLIT_K"] == 3
        assert fp4_gemm.plan_forward(M, 3584, 3584, torch.bfloat16, cuda)["SPLIT_K"] == 2
    assert fp4_gemm.plan_forward(64, 7168, 5120, torch.bfloat16, cuda)["SPLIT_K"] == 2  # 14B q/k/v: 112 tiles


def test_bench_table_names_every_planned_kernel(monkeypatch):
    """`python fp4_gemm.py --bench` prints one table row per problem whatever kernel the per-shape plan
    picked (a missing key in one plan kind once lost a GPU run's table)."""
    monkeypatch.setattr(fp4_gemm, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")  # plan_forward's GPU table; nothing runs on a GPU here
    rows = []
    for i, (M, (K, parts, _)) in enumerate([(M, s) for M in fp4_gemm.BENCH_M for s in fp4_gemm.QWEN7B_SHAPES.values()]):
        N = sum(parts)
        plan = fp4_gemm.plan_forward(M, N, K, torch.bfloat16, cuda)
        rows.append(dict(shape=f"s{i}", M=M, N=N, K=K, direction="fwd", plan=plan, ms=1e-3 * (i + 1), err=1e-3,
                         cublas_ms=2e-3, cublas_err=2e-3, tbps=1.0, tflops=2.0, ratio=2.0 / (i + 1)))
    rows.append(dict(rows[-1], shape="dx", direction="dx", plan=fp4_gemm.plan_dx(4096, 3584, 18944, torch.bfloat16, cuda)))
    for M in (1, 64, 4096):  # and every config --tune may report as the best
        rows += [dict(rows[-1], shape="s-tune", M=M, plan=p) for p in fp4_gemm._candidates(M, 37888, 3584, "fwd")]
    lines = fp4_gemm._table(rows, 4.25, device="a GPU").splitlines()
    body = [l for l in lines if l.startswith("| s") or l.startswith("| dx")]
    assert len(body) == len(rows)
    assert {r["plan"]["kernel"] for r in rows} == {"mma", "gemv", "wgmma", "tiled", "dequant"}
    for r, line in zip(rows, body):
        label = {"mma": "mma ", "gemv": "gemv ", "wgmma": "wgmma ", "tiled": "tiled ",
                 "dequant": "dequant+cuBLAS"}[r["plan"]["kernel"]]
        assert f"| {label}" in line and f"| {r['ms'] * 1e3:.1f} |" in line, line


# ------------------------------------------------------------------------------------------------
# The mma kernel's PTX block on the CPU: a warp-wide emulator of the dozen PTX instructions it uses
# ------------------------------------------------------------------------------------------------

def _bf16_to_f32(h):  # uint32 arrays holding 16-bit patterns → float32 values (exact)
    return (h.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f):  # round to nearest even
    b = f.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _halves(v, ty):
    lo, hi = v & 0xFFFF, v >> 16
    if ty == "bf16":
        return _bf16_to_f32(lo), _bf16_to_f32(hi)
    return lo.astype(np.uint16).view(np.float16).astype(np.float32), hi.astype(np.uint16).view(np.float16).astype(np.float32)


def _pack(lo, hi, ty):
    if ty == "bf16":
        return _f32_to_bf16(lo) | (_f32_to_bf16(hi) << 16)
    return lo.astype(np.float16).view(np.uint16).astype(np.uint32) | (hi.astype(np.float16).view(np.uint16).astype(np.uint32) << 16)


def run_ptx_warp(asm, operands):
    """Run an inline-asm block for the 32 lanes of a warp at once. operands: {"$k": array (32,)} of uint32
    (float32 for the f32 accumulators); returns the registers. Implements only what the mma blocks
    use: mov, and, or, shl, shr, mul.lo.u32, prmt (default mode), mul.rn.{bf16,f16}x2 and
    mma.sync.aligned.m16n8k16.row.col.f32 with the PTX ISA's fragment layout."""
    regs = {k: np.asarray(v) for k, v in operands.items()}
    lane = np.arange(32)
    g, t = lane // 4, lane % 4

    def val(x):
        x = x.strip()
        if x in regs:
            return regs[x]
        return np.full(32, int(x, 0), dtype=np.uint64).astype(np.uint32)

    for ins in asm.strip().strip("{}").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        if op.startswith("mma.sync"):
            ty = op.split(".")[-3]
            d, a, b, c = [[r.strip() for r in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}", rest)]
            A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
            for i, (rows, cols) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                lo, hi = _halves(regs[a[i]].astype(np.uint32), ty)
                A[rows, cols], A[rows, cols + 1] = lo, hi
            for i, rows in enumerate((2 * t, 2 * t + 8)):
                lo, hi = _halves(regs[b[i]].astype(np.uint32), ty)
                B[rows, g], B[rows + 1, g] = lo, hi
            for i, (rows, cols) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                C[rows, cols] = val(c[i])
            D = A @ B + C
            for i, (rows, cols) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                regs[d[i]] = D[rows, cols].astype(np.float32)
            continue
        args = [x.strip() for x in rest.split(",")]
        dst, src = args[0], [val(x) for x in args[1:]]
        u = [s.astype(np.uint64) for s in src]
        if op == "mov.b32":
            out = src[0]
        elif op == "and.b32":
            out = u[0] & u[1]
        elif op == "or.b32":
            out = u[0] | u[1]
        elif op == "shl.b32":
            out = (u[0] << u[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            out = u[0] >> u[1]
        elif op == "mul.lo.u32":
            out = (u[0] * u[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            pool = u[0] | (u[1] << 32)  # bytes 0-3 from a, 4-7 from b
            out = sum(((pool >> (8 * ((u[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op in ("mul.rn.bf16x2", "mul.rn.f16x2"):
            ty = op.split(".")[-1][:-2]
            (a0, a1), (b0, b1) = _halves(src[0].astype(np.uint32), ty), _halves(src[1].astype(np.uint32), ty)
            out = _pack(a0.astype(np.float64) * b0, a1.astype(np.float64) * b1, ty)
        else:
            raise NotImplementedError(op)
        regs[dst] = np.asarray(out).astype(np.uint32)
    return regs


@pytest.mark.skipif(not fp4_gemm.HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("half", [0, 1])
def test_mma_ptx_block_emulated(f16, half):
    """The PTX block the mma kernel runs (decode + scale + mma.sync over a warp), executed by a CPU
    emulator of its instructions, against float64 on the same lane layout: lane 4g + t holds words
    k = 8w + i of rows g and g + 8 (w = 0..3), x of token g at the same k, and gets rows g / g + 8 at
    tokens 2t / 2t + 1. The GPU test above checks the real PTX against the kernel's model."""
    rng = np.random.default_rng(7 + 2 * half + f16)
    words = {r: rng.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32) for r in ("top", "bot")}
    sbytes = {r: rng.integers(0, 0x7F, (32, 4)).astype(np.uint8) | (rng.integers(0, 2, (32, 4)) << 7).astype(np.uint8)
              for r in ("top", "bot")}  # E4M3 scales (no NaN code 0x7F/0xFF), either sign
    x = rng.standard_normal((32, 4, 8)).astype(np.float32)  # lane, word, i
    if f16:
        xbits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    else:
        xbits = _f32_to_bf16(x)
    xq = (xbits[:, :, 0::2] | (xbits[:, :, 1::2] << 16)).astype(np.uint32)  # (lane, word, pair j): (x[2j], x[2j+1])
    acc = rng.standard_normal((32, 4)).astype(np.float32)
    ops = {}
    for i in range(4):
        ops[f"${4 + i}"], ops[f"${8 + i}"] = words["top"][:, i], words["bot"][:, i]
        ops[f"${30 + i}"] = acc[:, i]
    for r, k in (("top", 12), ("bot", 13)):
        s = sbytes[r].astype(np.uint32)
        ops[f"${k}"] = s[:, 0] | (s[:, 1] << 8) | (s[:, 2] << 16) | (s[:, 3] << 24)
    for w in range(4):
        for j in range(4):
            ops[f"${14 + 4 * w + j}"] = xq[:, w, j]
    asm = fp4_gemm._mma_asm(f16, half)
    regs = run_ptx_warp(asm, ops)
    got = np.stack([regs[f"${i}"] for i in range(4)], 1).astype(np.float64)  # (lane, 4)

    e2m1 = np.array(E2M1_SIGNED)
    xv = (x.astype(np.float16) if f16 else _bf16_to_f32(xbits)).astype(np.float64)  # (lane, word, i)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    want = np.zeros((32, 4))
    for r_i, r in enumerate(("top", "bot")):
        codes = (words[r][:, :, None].astype(np.int64) >> (4 * np.arange(8))) & 0xF  # (lane, word, i)
        scale = torch.tensor(sbytes[r]).view(torch.float8_e4m3fn).double().numpy()  # (lane, 4 bytes)
        wv = e2m1[codes] * scale[:, [2 * half + wi // 2 for wi in range(4)]][:, :, None] / 256  # * 2^-8
        for L in range(32):
            for c_i, tok in enumerate((2 * t[L], 2 * t[L] + 1)):
                quad = (g == g[L])  # lanes holding row g[L] (one per t')
                src = (g == tok)  # lanes holding token `tok` (one per t')
                want[L, 2 * r_i + c_i] = acc[L, 2 * r_i + c_i] + (wv[quad] * xv[src]).sum()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not fp4_gemm.HAS_TRITON, reason="needs triton")
def test_decode_ptx_blocks_emulated():
    """The GEMV's word decode and the tiles' byte decode (PTX, GPU only) on the CPU emulator: every code
    comes out as e2m1 * 2^-14 (float16 pairs), or as e2m1 * scale in bf16 / float16 pairs."""
    rng = np.random.default_rng(3)
    e2m1 = np.array(E2M1_SIGNED)
    q = rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)  # one word of 8 codes a lane
    code = lambda k: (q.astype(np.int64) >> (4 * k)) & 0xF  # k = 2 * byte + nibble
    regs = run_ptx_warp(fp4_gemm._e2m1_word_asm(), {"$4": q})
    for out, (k_lo, k_hi) in (("$0", (3, 7)), ("$1", (1, 5)), ("$2", (2, 6)), ("$3", (0, 4))):
        lo, hi = _halves(regs[out], "f16")
        np.testing.assert_array_equal(lo * 2.0**14, e2m1[code(k_lo)])
        np.testing.assert_array_equal(hi * 2.0**14, e2m1[code(k_hi)])
    for ty, shift, mask, mul, power in (("bf16", 6, "0x01C001C0", "mul.rn.bf16x2", 126),
                                        ("f16", 3, "0x0E000E00", "mul.rn.f16x2", 14)):
        # decoded codes read e2m1 * 2^-power; the kernels' scale pair is s * 2^power (s exact, few bits)
        s = rng.choice([0.5, 0.75, 1.0, 1.5, 2.0, 3.0], (32, 4))  # each byte's own scale
        sp = (s * 2.0**power).astype(np.float32)
        regs = run_ptx_warp(fp4_gemm._e2m1_asm(shift, mask, mul),
                            {"$4": q, "$5": _pack(sp[:, 0], sp[:, 1], ty), "$6": _pack(sp[:, 2], sp[:, 3], ty)})
        for out, (b_lo, b_hi), nib in (("$0", (0, 1), 0), ("$1", (2, 3), 0), ("$2", (0, 1), 1), ("$3", (2, 3), 1)):
            lo, hi = _halves(regs[out], ty)
            np.testing.assert_array_equal(lo, e2m1[code(2 * b_lo + nib)] * s[:, b_lo])
            np.testing.assert_array_equal(hi, e2m1[code(2 * b_hi + nib)] * s[:, b_hi])


@pytest.mark.skipif(not fp4_gemm.HAS_GLUON, reason="needs triton with Gluon")
@pytest.mark.parametrize("f16", [False, True])
def test_wgmma_decode_and_k_order_emulated(f16):
    """The wgmma kernel's word decode (PTX, run on the CPU emulator) and its K order. Lane 4g + t decodes
    the 16 bytes of row g at physical k (bk/4) t .. of each k-step; the 8 values of word j, in the order
    the asm emits them, fill wgmma's register operand, which per the PTX ISA gives the lane columns 2t,
    2t+1, 2t+8, 2t+9 of each k16 chunk (chunk-major: element 4 a + 2 b + h of word j goes to chunk 2 j +
    a, column 8 b + 2 t + h). x permuted by wgmma_k_order must then meet every weight at its own k: the
    product equals W @ x in float64."""
    rng = np.random.default_rng(11 + f16)
    bk, K = 128, 256
    codes = rng.integers(0, 16, (8, K))  # 8 rows (g), physical k
    sbytes = rng.integers(0, 0x7F, (8, K // 16)) | (rng.integers(0, 2, (8, K // 16)) << 7)  # E4M3, no NaN
    scale = torch.tensor(sbytes.astype(np.uint8)).view(torch.float8_e4m3fn).double().numpy()  # (8, K/16)
    w = np.array(E2M1_SIGNED)[codes] * np.repeat(scale, 16, axis=1)  # (8, K) float64
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    a_mat = np.zeros((8, K))  # the MMA's left operand, column = logical k
    for s in range(K // bk):
        for j in range(bk // 32):
            k0 = s * bk + (bk // 4) * t + 8 * j  # (lane,): physical k of the word's first code
            word = sum(codes[g, k0 + i].astype(np.uint64) << (4 * i) for i in range(8)).astype(np.uint32)
            sv = scale[g, k0 // 16] * (2.0**6 if f16 else 2.0**118)
            ty = "f16" if f16 else "bf16"
            regs = run_ptx_warp(fp4_gemm._wgmma_word_asm(f16), {"$4": word, "$12": _pack(sv, sv, ty)})
            for r in range(4):
                for h, v in enumerate(_halves(regs[f"${r}"], ty)):
                    e = 2 * r + h
                    a, b = e // 4, (e // 2) % 2
                    a_mat[g, s * bk + 16 * (2 * j + a) + 8 * b + 2 * t + (e % 2)] = v
    x = rng.standard_normal((5, K))
    order = fp4_gemm.wgmma_k_order(K, bk, torch.device("cpu")).numpy()
    assert sorted(order) == list(range(K))
    np.testing.assert_allclose(a_mat @ x[:, order].T * 256, w @ x.T, rtol=1e-12, atol=1e-12)


@needs_triton
def test_pdl_launch_options_only_where_they_run(monkeypatch):
    """Programmatic dependent launch needs a Hopper or newer GPU: never on CPU tensors (the interpreter),
    never with QERL_PDL=0 (the choice it sets), and with it the kernels' PDL flag goes with the launch
    option."""
    assert fp4_gemm.pdl_opts(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setitem(fp4_gemm._choice, "pdl", False)
    assert fp4_gemm.pdl_opts(torch.device("cuda")) == {"PDL": False}
    if torch.cuda.is_available():
        monkeypatch.setitem(fp4_gemm._choice, "pdl", True)
        on = torch.cuda.get_device_capability() >= (9, 0) and fp4_gemm.HAS_PDL
        assert fp4_gemm.pdl_opts(torch.device("cuda")) == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})


@pytest.mark.parametrize("M,K,bk,dtype,strided", [(3, 256, 128, torch.bfloat16, False),
                                                  (5, 768, 256, torch.float16, True),
                                                  (1, 2176, 128, torch.float32, True)])
def test_k_ordered_kernel_is_wgmma_k_order(M, K, bk, dtype, strided, poisoned):
    """The Triton permutation in front of the wgmma kernel (k_ordered, its own copy of the order's
    formula) moves every element where wgmma_k_order (checked against the decode above) says, for
    row-strided and column-strided x; K = 2176 spans more than two of its blocks of 1024."""
    x = torch.randn(M, 2 * K, generator=torch.Generator().manual_seed(M + K)).to(DEV, dtype)
    x = x[:, ::2] if strided else x[:, :K]
    got = fp4_gemm.k_ordered(x, bk)
    assert torch.equal(got, x.index_select(1, fp4_gemm.wgmma_k_order(K, bk, x.device)))


def test_x_in_k_order_needs_the_warp_specialized_kernel():
    """fp4_linear_k_ordered takes x in the warp-specialized wgmma kernel's K order only where the plan
    runs that kernel (x_k_order's k_step > 0: 33-256 rows on a Hopper GPU); anywhere else it refuses rather than
    multiply a permuted x."""
    q = nvfp4.quantize(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    assert fp4_gemm.x_k_order(40, q, torch.bfloat16, x.device) == (0, 40)
    with fp4_gemm.backend("triton"), pytest.raises(ValueError, match="K order"):
        fp4_gemm.fp4_linear_k_ordered(x, q)
