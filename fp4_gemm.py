"""W4A16 matmul on an NVFP4 weight: y = x @ dequantize(W).T (+ bias), its dX, and QuantLinear.

NVFP4 (nvfp4.py) stores a weight W (N, K) as three tensors: 4-bit E2M1 codes c (N, K), packed two a
byte, element 2i in the low nibble; one FP8 E4M3 scale s per 16 consecutive values of a row (N, K/16);
and a float32 global scale g, one per tensor (or one per output row after fusing layers, see
QuantLinear.concat). Then

    W[n, k] = e2m1(c[n, k]) * s[n, k // 16] / g[n]
    y[m, n] = (256 / g[n]) * sum_k x[m, k] * (e2m1(c[n, k]) * s[n, k // 16] * 2^-8)

e2m1 * s * 2^-8 has at most 2 + 4 significant bits and lies in [2^-18, 10.5], so it is exact in bf16,
fp16 and fp32: a kernel can rebuild exact weights, accumulate in fp32 and apply the one inexact factor,
256/g, once per output. dX = dY @ W runs the same decode with the reduction over W's rows.

Why weight-only. Hopper (H100/H200) has no FP4 tensor cores, so, as Marlin does, the kernel reads the
4.5-bit weight, decodes it to bf16 in registers and feeds ordinary bf16 tensor-core MMAs. Decoding an
LLM is memory-bound, so reading 4.5 bits a weight instead of 16 is the win (3.56x fewer bytes).

Decoding without tables. Both formats are tiny floats, so bit moves do the work:
- E4M3 (s eeee mmm, exponent bias 7), shifted left by 7, is a float16 worth the E4M3 value * 2^-8:
  float16 keeps E4M3's 3 mantissa bits at its top, and the subnormals line up too.
- E2M1 (s ee m, bias 1) with its sign moved to bit 15 and e e m to bits 11..9 is a float16 worth
  e2m1 * 2^-14. The code with e = 0 (value 0.5) becomes a subnormal, which is exactly right. The missing
  power of two is folded into the block scale.
`decode_plain` below does this with Triton integer ops, which also run in Triton's interpreter on a CPU;
on a GPU the engine room hands the same kernel a PTX version of it (a few instructions a pair of values).

This file, top to bottom: the torch reference (dequantize + matmul); one portable Triton kernel (fused
dequantize + tl.dot tiles, split-K where K is long) and its dX; the dispatch point; the op
torch.ops.qerl.fp4_linear with autograd; QuantLinear. The reference is the specification: every faster
kernel is tested against it in float64.

The engine room (engine/, see engine/__init__.py) holds what makes it fast on a GPU, tested against this
file's functions: the same decode as PTX, two values an instruction (engine/ptx.py); a tensor-core GEMV
for decode's few rows (mma.sync, engine/mma.py); Hopper's wgmma with a producer warp, persistent
programs and stream-K (engine/wgmma.py); dequant + cuBLAS for large M; and the per-shape table that picks
one (engine/plan.py). What each measured: results/fp4_gemm_h200.md; `python fp4_gemm.py --bench`. The
engine takes only public names from here; this file reaches it only at its dispatch point.

Paths (fp4_backend.py, re-exported here). "auto": CUDA tensors go to the engine room, CPU tensors to the
torch reference; `set_backend`, the `backend(...)` context manager or QERL_FP4_BACKEND force "torch" or
"triton" (on CPU tensors: Triton's interpreter) and may pin a kernel; inside `fp8_tensor_cores()` every
path gives way to FP8 tensor cores (engine/fp8.py), train.py's --fp8-update; inside `dequant_plan()`
(train.update) the engine runs dequant + cuBLAS whatever the token count.

Departures from the official QeRL code: it runs rollouts on vLLM's Marlin FP4 kernel and trains by
dequantizing the whole weight on every forward in HF; here one set of kernels serves both, the backward
re-dequantizes instead of saving a bf16 copy, and q/k/v and gate/up can be fused into one matmul
(per-row global scales keep the separately quantized parts exact).
"""
import functools
import importlib
from typing import Optional

import torch
import torch.nn as nn

import fp4_backend
import nvfp4
from fp4_backend import (BACKENDS, HAS_TRITON, KERNELS, backend, dequant_plan, fp8_tensor_cores,  # noqa: F401
                         launch_opts, launchable, pinned_kernel, set_backend, split_k, uses_triton)

if HAS_TRITON:
    import triton
    import triton.language as tl

_choice = fp4_backend.choice  # the live choice of path, read by the dispatch point and the op


# ---------------------------------------------------------------------------------------------
# The torch reference: dequantize, then an ordinary matmul (the specification; the CPU path)
# ---------------------------------------------------------------------------------------------

def dequantize(packed, scale, global_scale, dtype=torch.float32):
    """(N, K) weight in `dtype` from the three stored tensors (global_scale (1,) or (N,)): nvfp4.dequantize's
    float32 arithmetic, the reference the Triton dequant kernel matches bit for bit."""
    return nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scale, global_scale), dtype)


def torch_linear(x2, packed, scale, gs, bias):
    """y (M, N) = x2 (M, K) @ dequantize(W)^T (+ bias) in x2's dtype: the torch path of fp4_linear."""
    w = dequantize(packed, scale, gs, x2.dtype)  # (N, K), dropped on return
    y = x2 @ w.t()  # (M, N)
    return y + bias.to(y.dtype) if bias is not None else y


def torch_dx(g2, packed, scale, gs):
    """dX (M, K) = g2 (M, N) @ dequantize(W) in g2's dtype: the torch path of fp4_linear's backward."""
    return g2 @ dequantize(packed, scale, gs, g2.dtype)  # (M, K)


# ---------------------------------------------------------------------------------------------
# The portable Triton kernel: fused dequantize + tl.dot tiles, split-K, and its dX
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    @triton.jit
    def e4m3_to_f32(b, factor: tl.constexpr = 256.0):
        """uint8 E4M3 bits → float32 values * factor / 256 (exact): as float16 bits shifted left by 7
        they read value * 2^-8."""
        b = b.to(tl.uint16)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * factor

    @triton.jit
    def e2m1_to_f32(c):
        """E2M1 codes (uint16, 0..15) → float32 e2m1 * 2^-14 (exact, via float16 bits; 0.5 is subnormal)."""
        h = ((c & 0x7) << 9) | ((c & 0x8) << 12)
        return h.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def decode_plain(p, sb, DTYPE: tl.constexpr):
        """Packed bytes p (BN, BK/16, 8) and their blocks' E4M3 scale bytes sb (BN, BK/16) → (lo, hi), the
        weights of even and odd k (the low and high nibbles), each (BN, BK/16, 8) and exactly
        e2m1 * s * 2^-8: (e2m1 * 2^-14) * (s * 2^6). DTYPE is the kernel's dot dtype; this decode works in
        fp32 whatever it is. engine/ptx.py's decode_ptx keeps this contract in a few PTX instructions."""
        s = e4m3_to_f32(sb, 16384.0)[:, :, None]  # (BN, BK/16, 1): scale * 2^6
        c = p.to(tl.uint16)
        lo = e2m1_to_f32(c & 0xF) * s  # (BN, BK/16, 8) codes of even k
        hi = e2m1_to_f32(c >> 4) * s  # odd k
        return lo, hi

    @triton.jit
    def w_pairs(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, DECODE: tl.constexpr, DTYPE: tl.constexpr):
        """W[rows, k0:k0+BLOCK_K] as exact e2m1 * scale * 2^-8 in DTYPE, split by parity, as stored:
        (lo, hi), each (BLOCK_N, BLOCK_K/2), lo[:, j] = W[:, k0 + 2j] and hi[:, j] = W[:, k0 + 2j + 1].
        DECODE: the decode function (decode_plain, or the engine's PTX one)."""
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        p_ptrs = wp_ptr + rows[:, None] * stride_wn + kb[None, :]  # (BN, BK/2) bytes, 2 codes each
        s_ptrs = ws_ptr + rows[:, None] * stride_sn + ks[None, :]  # (BN, BK/16) E4M3 bits
        if EVEN_K:
            p = tl.load(p_ptrs)
            sb = tl.load(s_ptrs)
        else:  # a zero byte decodes to +0, so the tail of K contributes nothing
            p = tl.load(p_ptrs, mask=kb[None, :] < K // 2, other=0)
            sb = tl.load(s_ptrs, mask=ks[None, :] < K // 16, other=0)
        p = tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 8))  # (BN, BK/16, 8): the 8 bytes of one block
        lo, hi = DECODE(p, sb, DTYPE)
        lo = tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)).to(DTYPE)
        hi = tl.reshape(hi, (BLOCK_N, BLOCK_K // 2)).to(DTYPE)
        return lo, hi

    @triton.jit
    def _w_tile(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, DECODE: tl.constexpr, DTYPE: tl.constexpr):
        """W[rows, k0:k0+BLOCK_K] in natural order: (BLOCK_N, BLOCK_K)."""
        lo, hi = w_pairs(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N, BLOCK_K, EVEN_K, DECODE, DTYPE)
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # k = 2 * byte + nibble

    @triton.jit
    def scale_bias(acc, rows, gs_ptr, bias_ptr, GS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr):
        """Sums of x * (W * g / 256) → outputs in fp32: times 256/g (g per tensor or per output row), plus
        the bias. rows: output-row indices broadcastable to acc, all in range."""
        if GS_PER_ROW:
            acc = acc * (256.0 / tl.load(gs_ptr + rows))
        else:
            acc = acc * (256.0 / tl.load(gs_ptr))
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rows).to(tl.float32)
        return acc

    @triton.jit
    def finish_tile(acc, offs_m, offs_n, pid_k, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym,
                    SPLIT_K: tl.constexpr, GS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr):
        """acc (BM, BN) fp32 sums of x * (W * g / 256) of output rows offs_m and columns offs_n: scale by
        256/g, add bias, store in y's dtype (or, with SPLIT_K > 1, store split pid_k's fp32 partial for
        splitk_reduce)."""
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if SPLIT_K > 1:
            ptrs = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
            tl.store(ptrs, acc, mask=mask)
        else:
            acc = scale_bias(acc, (offs_n % N)[None, :], gs_ptr, bias_ptr, GS_PER_ROW, HAS_BIAS)
            ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _grouped(pid, num_m, num_n, GROUP_M: tl.constexpr):
        """Program id → (m tile, n tile) in grouped order: GROUP_M consecutive programs share one
        weight tile, so it is read from HBM once and from L2 after."""
        width = GROUP_M * num_n
        first_m = (pid // width) * GROUP_M
        group_size = min(num_m - first_m, GROUP_M)
        return first_m + (pid % width) % group_size, (pid % width) // group_size

    @triton.jit
    def _tiled_kernel(x_ptr, wp_ptr, ws_ptr, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_ym,
                      stride_wn, stride_sn, k_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, GS_PER_ROW: tl.constexpr,
                      HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DECODE: tl.constexpr, DTYPE: tl.constexpr,
                      PRECISION: tl.constexpr):
        """Fused dequantize + tl.dot. Program (tile, split): a (BM, BN) output tile over K range `split`
        (k_split wide). Each k-step decodes a (BN, BK) weight tile into registers and multiplies it as
        tl.dot's right operand; with SPLIT_K > 1 the fp32 partials go to part_ptr for
        _splitk_reduce_kernel, so that a layer with few output tiles (long K, few rows) still fills the GPU."""
        pid = tl.program_id(0)
        pid_k = tl.program_id(1)
        pid_m, pid_n = _grouped(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_n % N
        x_rows = x_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_xm  # (BM, 1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        k_lo = pid_k * k_split
        for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
            w = _w_tile(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N, BLOCK_K, EVEN_K, DECODE,
                        DTYPE)  # (BN, BK)
            kk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(x_rows + kk[None, :])  # (BM, BK)
            else:
                x = tl.load(x_rows + kk[None, :], mask=kk[None, :] < K, other=0.0)
            acc = tl.dot(x.to(DTYPE), tl.trans(w), acc, input_precision=PRECISION)  # (BM, BN)
        finish_tile(acc, offs_m, offs_n, pid_k, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym,
                    SPLIT_K, GS_PER_ROW, HAS_BIAS)

    @triton.jit
    def _splitk_reduce_kernel(part_ptr, gs_ptr, bias_ptr, y_ptr, M, N, stride_ym, SPLIT_K: tl.constexpr,
                              BLOCK: tl.constexpr, GS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < M * N
        m = offs // N
        n = offs % N
        acc = tl.zeros((BLOCK,), tl.float32)
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + s * M * N + offs, mask=mask, other=0.0)
        acc = scale_bias(acc, n, gs_ptr, bias_ptr, GS_PER_ROW, HAS_BIAS)  # (n = offs % N is in range)
        tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tiled_dx_kernel(g_ptr, wp_ptr, ws_ptr, gs_ptr, dx_ptr, M, N, K, stride_gm, stride_dm,
                         stride_wn, stride_sn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, GS_PER_ROW: tl.constexpr, EVEN_N: tl.constexpr,
                         EVEN_K: tl.constexpr, DECODE: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
        """dX (BM, BK) tiles = dY (M, N) @ W (N, K): the reduction runs over W's rows, 16 columns of a
        row share a scale exactly as in the forward, so the same tile decoder serves."""
        pid = tl.program_id(0)
        pid_m, pid_k = _grouped(pid, tl.cdiv(M, BLOCK_M), tl.cdiv(K, BLOCK_K), GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        g_rows = g_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_gm  # (BM, 1)
        acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for n0 in range(0, N, BLOCK_N):
            nn_ = n0 + tl.arange(0, BLOCK_N)
            if EVEN_N:
                g = tl.load(g_rows + nn_[None, :])  # (BM, BN)
            else:  # rows past N are the reduction's tail: zero dY, so their (valid) weights add nothing
                g = tl.load(g_rows + nn_[None, :], mask=nn_[None, :] < N, other=0.0)
            if GS_PER_ROW:  # the global scale varies along the reduction: fold it into dY
                g = g.to(tl.float32) * (256.0 / tl.load(gs_ptr + nn_ % N))[None, :]
            w = _w_tile(wp_ptr, ws_ptr, stride_wn, stride_sn, nn_ % N, pid_k * BLOCK_K, K, BLOCK_N, BLOCK_K, EVEN_K,
                        DECODE, DTYPE)  # (BN, BK)
            acc = tl.dot(g.to(DTYPE), w, acc, input_precision=PRECISION)  # (BM, BK)
        if not GS_PER_ROW:
            acc = acc * (256.0 / tl.load(gs_ptr))
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        tl.store(dx_ptr + offs_m[:, None].to(tl.int64) * stride_dm + offs_k[None, :],
                 acc.to(dx_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------
# Launching the portable kernel (2-D x; uint8 views of the packed codes and the E4M3 scales)
# ---------------------------------------------------------------------------------------------

# Tiles for the interpreter (few, large programs run fastest there); engine/plan.py passes tuned ones.
# (launchable, launch_opts and split_k: fp4_backend.py.)
TILED_PLAN = dict(kernel="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, SPLIT_K=1, num_warps=4, num_stages=2)


def _tl_dtype(dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def _tile_opts(x, decode):
    """The tiled kernels' dot dtype and decode. The interpreter (triton 3.8) multiplies bf16 dot operands
    as raw bits, so on CPU the tiles are dotted in fp32: the same exact products, accumulated in fp32 as
    the tensor cores do."""
    tdt = _tl_dtype(x.dtype) if x.is_cuda else tl.float32
    return dict(DTYPE=tdt, PRECISION="ieee" if tdt == tl.float32 else "tf32", DECODE=decode or decode_plain)


def splitk_reduce(part, gs, bias, y):
    """y = the split-K partials part (S, M, N) summed in order, times 256/g, plus the bias."""
    M, N = y.shape
    block = 1024
    _splitk_reduce_kernel[(triton.cdiv(M * N, block),)](
        part, gs, bias if bias is not None else gs, y, M, N, y.stride(0), SPLIT_K=part.shape[0], BLOCK=block,
        GS_PER_ROW=gs.numel() > 1, HAS_BIAS=bias is not None, num_warps=4)


def tiled_linear(x2, packed, scale_u8, gs, bias, plan=None, decode=None):
    """y (M, N) = x2 (M, K) @ W^T (+ bias) with the tiled kernel. plan: its tiles and split (TILED_PLAN by
    default); decode: the decode function (decode_plain by default)."""
    plan = plan or TILED_PLAN
    M, K = x2.shape
    N = packed.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M == 0:
        return y
    bk = plan["BLOCK_K"]
    split, k_split = split_k(K, plan.get("SPLIT_K", 1), bk)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x2.device) if split > 1 else y  # fp32 partials
    grid = (triton.cdiv(M, plan["BLOCK_M"]) * triton.cdiv(N, plan["BLOCK_N"]), split)
    launchable(_tiled_kernel, x2.device)[grid](
        x2, packed, scale_u8, gs, bias if bias is not None else gs, y, part, M, N, K, x2.stride(0), y.stride(0),
        packed.stride(0), scale_u8.stride(0), k_split, BLOCK_M=plan["BLOCK_M"], BLOCK_N=plan["BLOCK_N"], BLOCK_K=bk,
        GROUP_M=plan["GROUP_M"], SPLIT_K=split, GS_PER_ROW=gs.numel() > 1, HAS_BIAS=bias is not None,
        EVEN_K=k_split * split == K, **_tile_opts(x2, decode), **launch_opts(plan))
    if split > 1:
        splitk_reduce(part, gs, bias, y)
    return y


def tiled_dx(g2, packed, scale_u8, gs, plan=None, decode=None):
    """dX (M, K) = g2 (M, N) @ W with the tiled dX kernel (plan: its tiles, TILED_PLAN by default)."""
    plan = plan or TILED_PLAN
    M, N = g2.shape
    K = packed.shape[1] * 2
    dx = torch.empty(M, K, dtype=g2.dtype, device=g2.device)
    if M == 0:
        return dx
    bm, bn, bk = plan["BLOCK_M"], plan["BLOCK_N"], plan["BLOCK_K"]
    grid = (triton.cdiv(M, bm) * triton.cdiv(K, bk),)
    launchable(_tiled_dx_kernel, g2.device)[grid](
        g2, packed, scale_u8, gs, dx, M, N, K, g2.stride(0), dx.stride(0), packed.stride(0), scale_u8.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=plan["GROUP_M"], GS_PER_ROW=gs.numel() > 1, EVEN_N=N % bn == 0,
        EVEN_K=K % bk == 0, **_tile_opts(g2, decode), **launch_opts(plan))
    return dx


# =============================================================================================
# THE DISPATCH POINT: where a shape leaves this file for the engine room (engine/plan.py)
# =============================================================================================

@functools.lru_cache(maxsize=None)
def _engine(part="plan"):
    """engine/<part>.py (plan: the per-shape kernels; fp8: the FP8 tensor-core products), imported on first
    use (only a GPU, a kernel pinned to the engine, or fp8_tensor_cores gets here); None where this file
    travels without its engine/ folder, or without the Triton that the engine needs. (Cached: asked on
    every call of a layer.)"""
    try:
        return importlib.import_module(f"engine.{part}")
    except ModuleNotFoundError as e:
        if e.name not in ("engine", f"engine.{part}", "triton"):
            raise
        return None


def _to_engine(x):
    """CUDA tensors go to the engine's per-shape plan, as does a kernel pinned to one of its kernels (the
    tests run those under the interpreter); CPU tensors otherwise run this file's tiled kernel."""
    return (x.is_cuda or _choice["kernel"] not in (None, "tiled")) and _engine() is not None


def fp8_supported(device):
    """Whether fp8_tensor_cores can run on `device` (engine/fp8.py's `supported`: FP8 tensor cores on a GPU,
    a torch._scaled_mm with one scale a row on the CPU); False without the engine."""
    fp8 = _engine("fp8")
    return fp8 is not None and fp8.supported(device)


def _triton_linear(x2, packed, scale_u8, gs, bias):
    if _to_engine(x2):
        return _engine().linear(x2, packed, scale_u8, gs, bias)
    return tiled_linear(x2, packed, scale_u8, gs, bias)


def _triton_dx(g2, packed, scale_u8, gs):
    if _to_engine(g2):
        return _engine().dx(g2, packed, scale_u8, gs)
    return tiled_dx(g2, packed, scale_u8, gs)


# ---------------------------------------------------------------------------------------------
# The op: torch.ops.qerl.fp4_linear (opaque to torch.compile, differentiable in x and bias)
# ---------------------------------------------------------------------------------------------
#
# Registered with torch.library.custom_op, with a fake implementation and autograd for dX, so that
# torch.compile treats a layer as one opaque call and CUDA graphs can capture it: no host syncs, no
# data-dependent allocations, configs fixed per shape (no autotuning at run time). Compile (warm up)
# each shape once before capturing a graph.

def check_operands(x, packed, scale, gs):
    """ValueError unless x (..., K) and the stored weight (packed (N, K/2), scale (N, K/16), global scale
    (1,) or (N,)) fit together."""
    n, k = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != k or scale.shape != (n, k // nvfp4.BLOCK) or gs.numel() not in (1, n):
        raise ValueError(f"fp4_linear: x {tuple(x.shape)} against packed {tuple(packed.shape)}, scale "
                         f"{tuple(scale.shape)}, global_scale {tuple(gs.shape)}")


@torch.library.custom_op("qerl::fp4_linear", mutates_args=())
def _fp4_linear_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    check_operands(x, packed, scale, global_scale)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if _choice["fp8"]:  # (fp8_tensor_cores: the update with --fp8-update)
        y = _engine("fp8").linear(x2, packed, scale.view(torch.uint8), global_scale.float(), bias)
    elif uses_triton(x.device):
        y = _triton_linear(x2, packed, scale.view(torch.uint8), global_scale.float(), bias)
    else:
        y = torch_linear(x2, packed, scale, global_scale, bias)
    if x.dim() == 2:  # the kernel's own tensor, not a view of it (LoRA adds into it in place)
        return y
    return y.reshape(*x.shape[:-1], packed.shape[0])


@_fp4_linear_op.register_fake
def _(x, packed, scale, global_scale, bias):
    return x.new_empty(*x.shape[:-1], packed.shape[0])


@torch.library.custom_op("qerl::fp4_linear_dx", mutates_args=())
def _fp4_linear_dx_op(grad: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                      global_scale: torch.Tensor) -> torch.Tensor:
    g2 = grad.reshape(-1, grad.shape[-1])
    if g2.stride(-1) != 1:
        g2 = g2.contiguous()
    if _choice["fp8"]:
        dx = _engine("fp8").dx(g2, packed, scale.view(torch.uint8), global_scale.float())
    elif uses_triton(grad.device):
        dx = _triton_dx(g2, packed, scale.view(torch.uint8), global_scale.float())
    else:
        dx = torch_dx(g2, packed, scale, global_scale)
    return dx.reshape(*grad.shape[:-1], packed.shape[1] * 2)


@_fp4_linear_dx_op.register_fake
def _(grad, packed, scale, global_scale):
    return grad.new_empty(*grad.shape[:-1], packed.shape[1] * 2)


def _setup_context(ctx, inputs, output):
    x, packed, scale, global_scale, bias = inputs
    ctx.save_for_backward(packed, scale, global_scale)  # the packed weight only: no bf16 copy is kept
    ctx.x_dtype = x.dtype
    ctx.bias_dtype = bias.dtype if bias is not None else None


def _backward(ctx, grad):
    packed, scale, global_scale = ctx.saved_tensors
    dx = _fp4_linear_dx_op(grad.to(ctx.x_dtype), packed, scale, global_scale) if ctx.needs_input_grad[0] else None
    dbias = None
    if ctx.needs_input_grad[4]:
        dbias = grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)
    return dx, None, None, None, dbias


_fp4_linear_op.register_autograd(_backward, setup_context=_setup_context)

def fp4_linear(x, q, bias=None):
    """x (..., K) @ dequantize(q).T (+ bias) → (..., N) in x's dtype, differentiable in x (and bias).
    q: an nvfp4.NVFP4Tensor (or anything with .packed, .scale, .global_scale); global_scale of shape
    (1,) or (N,). The weight never gets a gradient."""
    return torch.ops.qerl.fp4_linear(x, q.packed, q.scale, q.global_scale, bias)


# ---------------------------------------------------------------------------------------------
# QuantLinear: the drop-in module
# ---------------------------------------------------------------------------------------------

class QuantLinear(nn.Module):
    """A frozen linear layer stored in NVFP4; a drop-in for nn.Linear.

    Buffers carry compressed-tensors' names (weight_packed, weight_scale, weight_global_scale), so
    this module's state_dict keys are the checkpoint's keys. weight_global_scale is (1,) for a layer
    quantized alone and (out_features,) for layers fused by QuantLinear.concat."""

    def __init__(self, in_features, out_features, bias=True, device=None, dtype=torch.bfloat16, per_row_scale=False):
        super().__init__()
        if in_features % nvfp4.BLOCK:
            raise ValueError(f"QuantLinear: in_features {in_features} is not a multiple of {nvfp4.BLOCK}")
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight_packed", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device))
        self.register_buffer("weight_scale", torch.zeros(out_features, in_features // nvfp4.BLOCK,
                                                         dtype=torch.float8_e4m3fn, device=device))
        self.register_buffer("weight_global_scale", torch.ones(out_features if per_row_scale else 1,
                                                               dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear, name="weight", global_scale=None):
        m = cls(linear.in_features, linear.out_features, linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype)
        m.set_weight(linear.weight.data, name, global_scale)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.data)
        return m

    def set_weight(self, w, name="weight", global_scale=None):
        """Quantize the (N, K) float weight w into this layer's buffers, in place, with its own global
        scale or the one given (its fused group's: quantize_in_groups)."""
        q = nvfp4.quantize(w, name=name, global_scale=global_scale)
        self.weight_packed.copy_(q.packed)
        self.weight_scale.copy_(q.scale)
        self.weight_global_scale.copy_(q.global_scale)  # broadcasts into a per-row (N,) buffer too

    @classmethod
    def concat(cls, layers):
        """One QuantLinear whose output is torch.cat([l(x) for l in layers], -1): the rows of the
        separately quantized weights stacked, each keeping its own global scale (so the result is
        exact, not re-quantized). Fuses q/k/v or gate/up into one launch."""
        layers = list(layers)
        k = layers[0].in_features
        if any(l.in_features != k for l in layers):
            raise ValueError(f"concat: in_features differ: {[l.in_features for l in layers]}")
        n = sum(l.out_features for l in layers)
        ref = layers[0].weight_packed
        has_bias = any(l.bias is not None for l in layers)
        bias_dtype = next((l.bias.dtype for l in layers if l.bias is not None), torch.bfloat16)
        m = cls(k, n, has_bias, device=ref.device, dtype=bias_dtype, per_row_scale=True)
        m.weight_packed.copy_(torch.cat([l.weight_packed for l in layers]))
        m.weight_scale.copy_(torch.cat([l.weight_scale for l in layers]))
        m.weight_global_scale.copy_(torch.cat([l.weight_global_scale.float().expand(l.out_features)
                                               for l in layers]))
        if has_bias:
            m.bias.data.copy_(torch.cat([l.bias.data if l.bias is not None else
                                         torch.zeros(l.out_features, dtype=bias_dtype, device=ref.device)
                                         for l in layers]))
        return m

    @property
    def q(self):
        return nvfp4.NVFP4Tensor(self.weight_packed, self.weight_scale, self.weight_global_scale)

    def dequantized_weight(self, dtype=torch.float32):
        return dequantize(self.weight_packed, self.weight_scale, self.weight_global_scale, dtype)

    def forward(self, x):
        return fp4_linear(x, self.q, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, nvfp4"


def is_decoder_linear(name, module):
    """The layers QeRL quantizes: q/k/v/o and gate/up/down of every decoder layer, not lm_head."""
    return isinstance(module, nn.Linear) and name.split(".")[-1] in nvfp4.LINEAR_NAMES


def quantize_in_groups(layers, weight_of):
    """Quantize into each QuantLinear of `layers` ({key: QuantLinear}, keys as checkpoint keys or
    module names + '.weight') the float weight that weight_of(key) returns, one fused group at a time
    (nvfp4.fused_groups: q/k/v, gate/up of one layer), every member with the group's one global scale.
    That is the export's rule (nvfp4.save_quantized), so a model quantized here holds the codes and
    scales of the exported checkpoint bit for bit; only one group's float weights are alive at once.
    A layer whose group partners are not in `layers` keeps its own global scale."""
    for group in nvfp4.fused_groups(layers):
        weights = [weight_of(key) for key in group]
        shared = nvfp4.shared_global_scale(weights)
        for key, w in zip(group, weights):
            layers[key].set_weight(w, key, shared)


def quantize_model(model, filter=is_decoder_linear):
    """Swap every decoder nn.Linear of `model` (a model.Transformer) for a QuantLinear, in place, with
    the fused groups' shared global scales (quantize_in_groups): the model the exported checkpoint
    loads as. A group is the members `filter` picks: a linear picked without its partners, or under a
    name outside nvfp4.FUSED_GROUPS, gets its own global scale."""
    linears = {name + ".weight": m for name, m in model.named_modules() if name and filter(name, m)}
    quantized = {key: QuantLinear(m.in_features, m.out_features, m.bias is not None, device=m.weight.device,
                                  dtype=m.weight.dtype) for key, m in linears.items()}
    quantize_in_groups(quantized, lambda key: linears[key].weight.data)
    for key, q in quantized.items():
        if linears[key].bias is not None:
            q.bias.data.copy_(linears[key].bias.data)
    return model.swap_linears(lambda name, m: quantized[name + ".weight"], lambda name, m: name + ".weight" in quantized)


if __name__ == "__main__":  # the benchmark lives in the engine room; same flags, same table
    from engine.bench_gemm import main

    main()
