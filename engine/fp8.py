"""FP8 tensor cores for the update's GEMMs on an NVFP4 base: an option (`train.py --fp8-update`), off by default.

Speeds up: fp4_gemm.fp4_linear and its dX inside train.update (fp4_gemm.fp8_tensor_cores), where every
GEMM has thousands of rows of x and is bound by the tensor cores, not by memory. There the NVFP4 base
saves nothing: the dequant path (engine/plan.py) writes each weight in bf16 and runs cuBLAS at bf16's
rate, so the update costs what a bf16 base's does. Hopper's FP8 tensor cores multiply at twice that
rate. Here each weight is written in E4M3 instead of bf16, x (in backward, dY) is quantized to E4M3 row
by row, and torch._scaled_mm multiplies with one scale a row of each operand, accumulating in fp32.
Tested against: float64 products of the same E4M3 operands, the Triton kernels against the torch forms
here bit for bit under the interpreter, and the exact NVFP4 product within FP8's error
(tests/engine/test_fp8.py). Measurements (faster products, a shorter update where completions run long,
none where they stop early): results/fp8_update.md.

What it changes, and why it is an option: the trainer's logprobs move away from the sampler's, which
decodes with the exact NVFP4 weights and 16-bit activations (the mismatch every step logs grows well
past the default path's, and past what AQN's noise adds: results/fp8_update.md).
- The weight, W = e2m1 · s / g (nvfp4.py): W8 = E4M3(e2m1 · s / 8) with r = 8 / g per output row, so
  that W = W8 · r wherever e2m1 · s fits in E4M3's 4 significant bits; where it needs 5 (e2m1 of 1.5,
  3 or 6 times a scale with its last mantissa bit set) it is rounded, by at most 2^-4 relative. The
  largest weight, 6 · 448 / g, becomes 336: in range. Values below 2^-6 (E4M3's subnormals: blocks whose
  largest weight is under ~1/2000 of the layer's) are kept in steps of 2^-9, so with fewer bits.
- x: x8 = E4M3(x · 448 / amax), its row's amax / 448 as the row's scale. 4 significant bits where bf16
  has 8: an error of up to 2^-4 relative an element, and so a product further from the exact one than
  the bf16 path's (the errors of both at a 7B layer: results/fp8_update.md).
- dX = dY · W = (dY · r) · W8: dY is multiplied by r column by column, then quantized like x; the weight
  is the same W8, which the dequant kernel writes transposed for this product (cuBLAS wants its second
  operand column-major).
"""
import functools

import torch
import triton
import triton.language as tl

E4M3_MAX = 448.0  # E4M3's largest finite value (float8_e4m3fn)


def supported(device):
    """Whether these products can run on `device` (fp4_gemm.fp8_supported asks): a GPU with FP8 tensor cores
    (compute capability 8.9 and up), or the CPU where this torch's torch._scaled_mm takes one scale a row
    (slow: for the tests and the tiny run; older CPU builds take one scale a tensor only, so this asks the
    build in hand)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device) >= (8, 9)
    return device.type == "cpu" and _cpu_rowwise_scaled_mm()


@functools.lru_cache(maxsize=None)
def _cpu_rowwise_scaled_mm():
    a = torch.zeros(16, 16, dtype=torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError, AttributeError):
        return False
    return True


@triton.jit
def round_e4m3(x):
    """fp32 x (|x| <= 448) rounded to the nearest E4M3 value, ties to even, as fp32: what torch's cast to
    float8_e4m3fn does, done on the bits so that the cast after it is exact. (Triton's interpreter casts
    by truncating where rounding carries into the exponent: 127 became 64, not 128.)"""
    bits = x.to(tl.int32, bitcast=True)
    # normal E4M3 (|x| >= 2^-6): keep 3 of fp32's 23 mantissa bits, ties to even; a carry moves the exponent
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & ~0xFFFFF).to(tl.float32, bitcast=True)
    # subnormal E4M3 (|x| < 2^-6): multiples of 2^-9; adding and taking away 1.5 * 2^23 rounds |x| * 512 to
    # an integer, ties to even; then x's sign bit (so that -0 stays -0, as torch's cast keeps it)
    sub = ((tl.abs(x) * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    sub = (sub.to(tl.int32, bitcast=True) | (bits & -2147483648)).to(tl.float32, bitcast=True)
    return tl.where(tl.abs(x) < 0.015625, sub, normal)


@triton.jit
def _rows_e4m3_kernel(x_ptr, col_ptr, out_ptr, s_ptr, K, stride_x, BLOCK: tl.constexpr, HAS_COL: tl.constexpr):
    """Row m of x (times col, one factor a column, where given) in E4M3: amax over the row, then
    out = E4M3(v · (448 / amax)) and s = amax / 448, in two passes over the row."""
    m = tl.program_id(0).to(tl.int64)
    row = x_ptr + m * stride_x
    amax = tl.zeros((BLOCK,), tl.float32)
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(row + k, mask=k < K, other=0.0).to(tl.float32)
        if HAS_COL:
            v = v * tl.load(col_ptr + k, mask=k < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(v))
    a = tl.maximum(tl.max(amax, 0), 1e-30)  # (rollout.kv_e4m3's floor, E4M3_MAX: a kernel reads no Python globals)
    inv = tl.math.div_rn(448.0, a)  # IEEE divisions, as torch's
    for k0 in range(0, K, BLOCK):
        k = k0 + tl.arange(0, BLOCK)
        v = tl.load(row + k, mask=k < K, other=0.0).to(tl.float32)
        if HAS_COL:
            v = v * tl.load(col_ptr + k, mask=k < K, other=0.0)
        tl.store(out_ptr + m * K + k, round_e4m3(v * inv).to(out_ptr.dtype.element_ty), mask=k < K)
    tl.store(s_ptr + m, tl.math.div_rn(a, 448.0))


def rows_e4m3(t, col=None, kernel=None):
    """t (M, K) → (E4M3 (M, K), scales (M, 1) fp32), t ≈ q · s row by row; `col` (K,) fp32 multiplies the
    columns first. kernel (default: on the GPU): the Triton kernel, else torch ops (bit for bit the same)."""
    M, K = t.shape
    if t.is_cuda if kernel is None else kernel:
        if t.stride(-1) != 1:
            t = t.contiguous()
        q = torch.empty(M, K, dtype=torch.float8_e4m3fn, device=t.device)
        s = torch.empty(M, 1, dtype=torch.float32, device=t.device)
        if M:
            _rows_e4m3_kernel[(M,)](t, col if col is not None else t, q, s, K, t.stride(0),
                                    BLOCK=min(2048, triton.next_power_of_2(K)), HAS_COL=col is not None, num_warps=8)
        return q, s
    import rollout  # (the FP8 KV cache's quantizer, the same rule: one scale a row, amax / 448; imported here,
    # as fp4_gemm below: engine/plan.py imports this file)

    q, s = rollout.kv_e4m3(t.float() if col is None else t.float() * col)
    return q, s[:, None]


def weight_e4m3(packed, scale_u8, gs, kernel=None, transpose=False):
    """The frozen weight as (W8 (N, K) E4M3, r (N,) fp32), W ≈ W8 · r per row: W8 = E4M3(e2m1 · s / 8),
    r = 8 / g. On the GPU the dequant kernel writes it (engine/plan.py, the bf16 path's kernel with an
    E4M3 store; kernel=True elsewhere too), else nvfp4's dequantize in float32 with 8 for g and torch's cast.
    transpose: W8 comes as a (N, K) view of a contiguous (K, N) W8^T (what dX's product wants), which the
    kernel writes as such: torch's transposing copy of a 1-byte tensor took several times the
    dequantization (results/fp8_update.md)."""
    import fp4_gemm  # (engine/plan.py imports this file)
    n = packed.shape[0]
    eight = torch.full((1,), 8.0, dtype=torch.float32, device=packed.device)
    r = (8.0 / gs.float()).expand(n).contiguous()
    if packed.is_cuda if kernel is None else kernel:
        from engine import plan
        w8 = plan.dequantize_triton(packed, scale_u8, eight, torch.float8_e4m3fn, transpose=transpose)
        return (w8.t() if transpose else w8), r
    w8 = fp4_gemm.dequantize(packed, scale_u8.view(torch.float8_e4m3fn), eight, torch.float32).to(torch.float8_e4m3fn)
    return (w8.t().contiguous().t() if transpose else w8), r


def _mm(a8, sa, b8_t, sb, dtype):
    """(a8 · sa) @ (b8_t · sb) in fp32, out in `dtype`: a8 (M, K) row-major, b8_t (K, N) column-major,
    sa (M, 1), sb (1, N). cuBLAS produces bf16 with row-wise scales; other dtypes are cast from it."""
    y = torch._scaled_mm(a8, b8_t, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    return y if dtype == torch.bfloat16 else y.to(dtype)


def linear(x2, packed, scale_u8, gs, bias):
    """y (M, N) = x2 (M, K) @ W^T (+ bias), on FP8 tensor cores."""
    w8, r = weight_e4m3(packed, scale_u8, gs)
    x8, sx = rows_e4m3(x2)
    y = _mm(x8, sx, w8.t(), r[None], x2.dtype)
    return y + bias.to(y.dtype) if bias is not None else y


def dx(g2, packed, scale_u8, gs):
    """dX (M, K) = g2 (M, N) @ W = (g2 · r) @ W8, on FP8 tensor cores."""
    w8, r = weight_e4m3(packed, scale_u8, gs, transpose=True)  # (N, K), column-major
    g8, sg = rows_e4m3(g2, r)
    return _mm(g8, sg, w8, torch.ones(1, w8.shape[1], dtype=torch.float32, device=g2.device), g2.dtype)

