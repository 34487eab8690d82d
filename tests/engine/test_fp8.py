"""engine/fp8.py: the update's GEMMs on FP8 tensor cores (fp4_gemm.fp8_tensor_cores, train.py --fp8-update).

What is asserted and why:
- The E4M3 rounding the kernels do on the bits equals torch's cast to float8_e4m3fn, for every E4M3 value,
  every midpoint between two (ties to even), the values either side of them and the subnormal range: the
  kernels then store exact values, so they match torch on the GPU and under the interpreter alike.
- The Triton kernels (the weight through the dequant kernel's E4M3 store, the row quantization with and
  without a column factor) equal the torch forms bit for bit.
- The operands are what the docstring says: W8 · r is the NVFP4 weight up to E4M3's rounding of e2m1 · s
  (at most 2^-4 relative in E4M3's normal range, half a subnormal step below it, and exact wherever e2m1
  is a power of two and the value is normal), x8 · s within 2^-4 of x.
- The forward and dX equal float64 products of the same E4M3 operands (so the scales and the transpose
  are right), and the exact NVFP4 product within FP8's error.
- Outside fp8_tensor_cores nothing changes; inside, autograd's dX takes the FP8 path too.
"""
import pytest
import torch

import fp4_gemm
from engine import fp8
from fp4_ref import make_q, needs_triton, ref_weight, rel_err

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def e4m3_grid():
    """Every finite E4M3 value, the midpoints between neighbours, and the fp32 values either side of each."""
    vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    vals = vals[torch.isfinite(vals)].unique()
    vals = vals[vals.abs() <= fp8.E4M3_MAX]
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids])
    return torch.cat([x, torch.nextafter(x, x + 1), torch.nextafter(x, x - 1)]).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX)


@needs_triton
def test_round_e4m3_is_torch_cast():
    """On the bits, ties to even, exponent carries and subnormals included; the cast after it is exact."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + i, mask=i < N)
        tl.store(out_ptr + i, fp8.round_e4m3(x), mask=i < N)

    x = e4m3_grid().to(DEV)
    out = torch.empty_like(x)
    kernel[(triton.cdiv(x.numel(), 1024),)](x, out, x.numel(), BLOCK=1024)
    want = x.to(torch.float8_e4m3fn).float()
    assert torch.equal(out, want)
    assert torch.equal(out.to(torch.float8_e4m3fn).float(), out)  # exact: already E4M3 values


@needs_triton
@pytest.mark.parametrize("per_row", [False, True])
def test_weight_kernel_equals_torch(per_row):
    """The dequant kernel's E4M3 store against nvfp4's dequantize + torch's cast, and W8 · r against W."""
    q = make_q(40, 272, per_row, seed=31 + per_row)  # (on DEV)
    args = (q.packed, q.scale.view(torch.uint8), q.global_scale)
    w8, r = fp8.weight_e4m3(*args, kernel=True)
    w8_t, r_t = fp8.weight_e4m3(*(a.cpu() for a in args), kernel=False)
    assert w8.dtype == torch.float8_e4m3fn and torch.equal(w8.cpu().view(torch.uint8), w8_t.view(torch.uint8))
    assert torch.equal(r.cpu(), r_t)
    for kernel in (True, False):  # W8^T written as such: the same bytes, column-major
        w8_c, _ = fp8.weight_e4m3(*args, kernel=kernel, transpose=True)
        assert w8_c.shape == w8.shape and w8_c.stride() == (1, w8.shape[0])
        assert torch.equal(w8_c.cpu().view(torch.uint8), w8_t.view(torch.uint8))
    exact = ref_weight(q.packed, q.scale, torch.full_like(q.global_scale, 8.0))  # e2m1 · s / 8 in float64
    err = (w8_t.double() - exact).abs()
    # half a step of 4 significant bits in E4M3's normal range, half a subnormal step (2^-9) below it
    assert (err <= exact.abs() * 2**-4 + 2**-10).all()
    p = q.packed.cpu().long()
    codes = torch.stack([p & 0x7, (p >> 4) & 0x7], -1).reshape(exact.shape)
    pow2 = ((codes == 1) | (codes == 2) | (codes == 4) | (codes == 6)) & (exact.abs() >= 2**-6)  # e2m1 0.5, 1, 2, 4
    assert (err[pow2] == 0).all() and (err > 0).any()  # exact there; and some e2m1 · s do need rounding
    w = ref_weight(q.packed, q.scale, q.global_scale)
    assert torch.allclose(exact * (8 / q.global_scale.cpu().double().reshape(-1, 1)), w, rtol=1e-12, atol=0)  # W = W8 · r


@needs_triton
@pytest.mark.parametrize("with_col", [False, True])
def test_rows_kernel_equals_torch(with_col):
    """Row quantization at an odd width, a zero row, a huge one, a tiny one, and an exact E4M3 tie:
    kernel == torch, bit for bit. (The tie: 0.28125 · 448 / 1.5 is 84, halfway between 80 and 88, when
    448 / 1.5 is one IEEE division; torch's `448.0 / a` is 448 · (1 / a), which lands one fp32 step above
    84 and rounds to 88, as a first torch form here did.)"""
    g = torch.Generator().manual_seed(5)
    t = torch.randn(7, 2100, generator=g).to(torch.bfloat16)
    t[2] = 0
    t[3] *= 1e4
    t[4] *= 1e-6
    t[5] = 0
    t[5, :3] = torch.tensor([1.5, 0.28125, -0.28125])
    col = (torch.rand(2100, generator=g) * 4) if with_col else None
    q, s = fp8.rows_e4m3(t.to(DEV), col.to(DEV) if with_col else None, kernel=True)
    q_t, s_t = fp8.rows_e4m3(t, col, kernel=False)
    assert torch.equal(q.cpu().view(torch.uint8), q_t.view(torch.uint8)) and torch.equal(s.cpu(), s_t)
    v = t.double() * (col.double() if with_col else 1)
    back = q_t.double() * s_t.double()
    assert (back - v).abs().le(v.abs() * 2**-4 + s_t.double() * 2**-9).all()  # (2^-9: E4M3's subnormal step)
    assert (q_t[2].float() == 0).all()
    if not with_col:
        assert q_t[5, :3].float().tolist() == [448.0, 80.0, -80.0]


def _operands(M, K, N, per_row, seed, dtype=torch.bfloat16):
    q = make_q(N, K, per_row, seed=seed)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(seed), dtype=torch.float32).to(dtype)
    return q, x.to(DEV)


@pytest.mark.parametrize("M,K,N,per_row", [(5, 64, 48, False), (33, 272, 80, True)])
def test_forward_and_dx_against_float64(M, K, N, per_row):
    """fp4_linear inside fp8_tensor_cores: y and dX (through autograd) against float64 products of the same
    E4M3 operands (only fp32 accumulation and the bf16 output differ), and against the exact NVFP4
    product within FP8's error."""
    q, x = _operands(M, K, N, per_row, seed=M + K)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(1)).to(DEV, torch.bfloat16)
    gy = torch.randn(M, N, generator=torch.Generator().manual_seed(2)).to(DEV, torch.bfloat16)
    xg = x.clone().requires_grad_(True)
    with fp4_gemm.fp8_tensor_cores():
        y = fp4_gemm.fp4_linear(xg, q, bias)
        y.backward(gy)
    cpu = lambda t: t.cpu()
    x, gy, bias, y, dx = map(cpu, (x, gy, bias, y, xg.grad))
    w8, r = fp8.weight_e4m3(q.packed.cpu(), q.scale.view(torch.uint8).cpu(), q.global_scale.float().cpu(), kernel=False)
    x8, sx = fp8.rows_e4m3(x, kernel=False)
    g8, sg = fp8.rows_e4m3(gy, r, kernel=False)
    y_ref = (x8.double() * sx.double()) @ (w8.double() * r.double()[:, None]).t() + bias.double()
    dx_ref = (g8.double() * sg.double()) @ w8.double()
    assert rel_err(y.double(), y_ref) < 1e-2 and rel_err(dx.double(), dx_ref) < 1e-2
    w = ref_weight(q.packed, q.scale, q.global_scale)
    exact_y = x.double() @ w.t() + bias.double()
    exact_dx = gy.double() @ w
    assert rel_err(y.double(), exact_y) < 0.06 and rel_err(dx.double(), exact_dx) < 0.06
    # and it is not the bf16 path: that one is closer to the exact product
    y16 = fp4_gemm.fp4_linear(x.to(DEV), q, bias.to(DEV)).cpu()
    assert rel_err(y16.double(), exact_y) < rel_err(y.double(), exact_y)


def test_off_by_default_and_restored():
    """fp8_tensor_cores is off unless entered, and leaves the previous state on exit (an exception too)."""
    q, x = _operands(4, 64, 32, False, seed=3)
    before = fp4_gemm.fp4_linear(x, q)
    with pytest.raises(RuntimeError):
        with fp4_gemm.fp8_tensor_cores():
            assert not torch.equal(fp4_gemm.fp4_linear(x, q), before)  # x and W rounded to E4M3
            raise RuntimeError
    assert torch.equal(fp4_gemm.fp4_linear(x, q), before)
    with fp4_gemm.fp8_tensor_cores(False):
        assert torch.equal(fp4_gemm.fp4_linear(x, q), before)


def test_supported_is_asked_through_fp4_gemm(monkeypatch):
    """fp4_gemm.fp8_supported is this file's answer (on the CPU: whether this torch's _scaled_mm takes one
    scale a row, where the products then run), and False where fp4_gemm has no engine to hand them to."""
    cpu = torch.device("cpu")
    assert fp4_gemm.fp8_supported(cpu) == fp8.supported(cpu)
    if fp8.supported(cpu):
        q, x = _operands(4, 64, 32, False, seed=4)
        y = fp8.linear(x.cpu(), q.packed.cpu(), q.scale.view(torch.uint8).cpu(), q.global_scale.float().cpu(), None)
        assert y.shape == (4, 32) and y.isfinite().all()
    assert not fp8.supported(torch.device("meta"))
    monkeypatch.setattr(fp4_gemm, "_engine", lambda part="plan": None)  # (as without the engine/ folder)
    assert not fp4_gemm.fp8_supported(cpu)
