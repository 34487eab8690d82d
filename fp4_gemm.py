"""W4A16 matmul on an NVFP4 weight: y = x @ dequantize(W).T (+ bias), in Triton, and QuantLinear.

Hopper has no FP4 tensor cores, so this is weight-only quantization in the style of Marlin: the kernel
reads the packed 4-bit codes and the FP8 block scales, rebuilds bf16 weights in registers and feeds
ordinary bf16 tensor-core MMAs (or FMAs). The win is bytes: a weight costs 4.5 bits instead of 16, so
decoding, which is memory-bound, reads 3.56x fewer bytes per step.

The math. With codes c (N, K), block scales s (N, K/16) and a global scale g (one per tensor, or one
per output row after fusing layers, see QuantLinear.concat):

    W[n, k] = e2m1(c[n, k]) * s[n, k // 16] / g[n]
    y[m, n] = (256 / g[n]) * sum_k x[m, k] * (e2m1(c[n, k]) * s[n, k // 16] * 2^-8)

The product e2m1 * s * 2^-8 has at most 2 + 4 significant bits and lies in [2^-18, 10.5], so it is
exact in bf16, fp16 and fp32: the kernels build exact weights, accumulate in fp32 and apply the one
inexact factor, 256/g, once per output in the epilogue. (The torch path rounds W to x's dtype first,
as nvfp4.dequantize does; both agree with a float64 reference to bf16 rounding.)

Decoding in registers, without tables. Both formats are tiny floats, so bit moves do the work:
- E4M3 (s eeee mmm, bias 7) shifted left by 7 is a float16 whose value is the E4M3 value * 2^-8,
  subnormals included, because float16 keeps E4M3's 3 mantissa bits at its top and subnormals
  line up too.
- E2M1 (s ee m, bias 1) shifted into float16's low exponent bits (sign to bit 15, e e m to bits
  11..9) reads as e2m1 * 2^-14; into bf16's (bits 8..6) as e2m1 * 2^-126. The code with e = 0
  (value 0.5) becomes a subnormal, which is exactly right. The missing power of two is folded into
  the block scale.
On the GPU this is PTX on 32-bit registers, two values an instruction. For the mma and wgmma kernels:
a mask keeps one code per 16-bit half, one integer multiply copies it to two places at once (e e m
under bf16's exponent, the sign to bit 15), a second mask keeps those bits, and one `mul.bf16x2`
applies the block scale. The GEMV turns a word of 8 codes into 4 float16 pairs in 13 integer
instructions; the tiles use `prmt` + masks + one `mul.bf16x2`. At decode speed an SM has only a few
issue slots per weight, so the decode must stay short. Under the Triton interpreter (CPU) the same
numbers come from plain Triton integer ops; GPU tests check that both decodes agree bit for bit, and
the CPU tests run every PTX block through a small warp-wide emulator of the instructions it uses.

The kernels. `plan_forward` / `plan_dx` pick one per shape from a small fixed table, read off
`python fp4_gemm.py --bench/--tune` on an H200 (Qwen2.5 shapes; results/fp4_gemm_h200.md holds every
measurement and every variant tried and dropped). The ratios are to cuBLAS bf16 on the same shape.

- mma: one row of x on Hopper, up to 8 elsewhere (16-bit x, K a multiple of 64). Tensor cores for a
  GEMV, as Marlin does: the weight is mma.sync's left operand (16 rows x 16 k), x the right one (k x 8
  tokens, zeros beyond M). Which physical k an MMA column stands for is free as long as both operands
  agree, so each lane loads 16-byte pieces of its own two weight rows, decodes them and feeds them to
  mma.sync with x loaded at the same k: no data crosses lanes (Triton lays a (lane, tile, 4 words)
  load out one lane per index, which is what makes this expressible). Split-K programs leave fp32 partials,
  and the last one to finish a tile (an atomic ticket) sums them in order: deterministic, one launch.
  1.7-2.5x cuBLAS at one row (gate/up at 2.4 TB/s).
- gemv: one row of fp32 x. A program owns 8 weight rows and walks K with 16-byte loads, in fp32.
- wgmma (Gluon, Hopper, 2-256 rows; wide and long-K layers further): the same idea on the warpgroup
  MMA. A warpgroup owns 64 weight rows; x sits in shared memory once per program, in the K order each
  lane decodes (`k_ordered`); the decoded weights are wgmma's left operand straight from registers;
  each 64-k slice multiplies while the next one decodes, and the next k-step loads meanwhile. From 33
  rows (17 for gate/up-like layers) it is warp-specialized: a producer warp fills a ring of
  shared-memory stages by TMA and two or three consumer warpgroups only decode and multiply. For
  gate/up-like layers at 129-2048 rows and down-like ones at 257-512 it is persistent (one program an
  SM walking the tiles) with stream-K (the last waves' k-steps shared out evenly). Where a layer's
  tiles leave a partial last wave, only those tiles split K. 1.4-2.6x cuBLAS at 4-16 rows; at 64 rows
  1.8x / 1.6x for gate/up / down, 1.0x / 0.9x for q/k/v / o; 0.85-1.0x for gate/up at 256-2048.
- tiled (2-128 rows where mma and wgmma do not serve: GPUs other than Hopper, K not a multiple of
  128): fused dequantize + tl.dot tiles, grouped tile order so that a weight tile is read from HBM
  once, split-K where the tiles are few.
- dequant + cuBLAS (the remaining large M, and fp32 x): a Triton kernel writes this one layer's
  weight in x's dtype, bit-identical to nvfp4.dequantize, cuBLAS multiplies, and the copy dies at
  once. Writing that weight is the cost: 0.73-0.81x cuBLAS at 1024 rows, 0.75-0.95x at 4096.
- dX backward (dY @ W): dequant + cuBLAS above 128 rows, the tiled kernel transposed below. Either way
  at most one layer's dequantized weight is alive, never a bf16 copy of the model.
- A product riding along (`fp4_linear_side`): rollout's LoRA A products (x @ A^T for a small bf16 A)
  as extra programs of the mma launch, so a decode projection costs one launch, not two;
  `small_linear` is the same product as a launch of its own.

What bounds them, on an H200 (the device copy runs at 4.24 TB/s):
- One row (mma): for gate/up, compute alone takes 18 us and the loads alone 24, and they overlap only
  in part (32 us). A kernel that only reads the codes in the same pattern reaches 3.3-4.1 TB/s, and
  this one draws 694 W, at the board's power cap: what would help is less work a weight. Fewer ALU
  instructions (a quarter to half of the loop's) gained 0-6%; loads issued earlier (into registers,
  into L2, through a shared-memory ring) lost.
- 64 rows (wgmma): tensor cores, issue slots and DRAM each bound gate/up at ~18 us, and the plain
  kernel took ~51: the three overlap poorly within one warpgroup. The producer warp and the three
  consumer warpgroups took it to ~46 us.
- 1024 rows and up: compute dominates, and the decode work per weight is what bf16 does not pay.
  Dequant + cuBLAS cannot pass ~0.8x at 1024 rows; the fused kernels measured 0.62-0.84x there.

Running inside CUDA graphs and torch.compile. The op is registered as `torch.ops.qerl.fp4_linear`
(torch.library.custom_op, with a fake implementation and autograd for dX), so torch.compile treats a
layer as one opaque call and CUDA graphs can capture it: no host syncs, no data-dependent allocations,
configs fixed per shape (no autotuning at run time). Compile (warm up) each shape once before
capturing a graph. On Hopper and newer GPUs the decode kernels (mma, wgmma, small_linear, k_ordered)
use programmatic dependent launch: each may be scheduled while the kernel before it finishes, and waits
for it on the GPU (`pdl_opts`, `pdl_wait`; rollout.py's kernels do the same). The mma and plain wgmma
kernels let the next kernel launch once past their k loop (`pdl_launch_next`), and called for decode,
where no kernel writes a weight, the mma kernel loads its first k-step of codes before its wait.
QERL_PDL=0 turns this off. A caller whose own kernel produces x can store it in the wgmma kernel's K
order itself and skip that launch (x_k_order, k_ordered_tile, fp4_linear_k_ordered).

Paths: Triton on CUDA tensors, the torch path (dequantize + matmul) on CPU, chosen automatically.
`set_backend("torch" | "triton" | "auto", kernel=None)` or the `backend(...)` context manager, or the
environment variable QERL_FP4_BACKEND, force one; with "triton" on CPU tensors the kernels run in
Triton's interpreter (that is how the tests check them). `kernel` pins "mma", "gemv", "wgmma", "tiled"
or "dequant". Gluon has no interpreter: on CPU the tests run its PTX on the emulator and check its K
order; on a Hopper GPU they check the kernel against float64.

Departures from the official QeRL code: it runs rollouts on vLLM's Marlin FP4 kernel and trains by
dequantizing the whole weight on every forward in HF; here one set of kernels serves both, the
backward re-dequantizes instead of saving a bf16 copy, and q/k/v and gate/up can be fused into one
matmul (per-row global scales keep the separately quantized parts exact).
"""
import argparse
import contextlib
import functools
import math
import os
import sys
from typing import Optional

import torch
import torch.nn as nn

import nvfp4

# Without a GPU, Triton can only run kernels through its interpreter, and it reads TRITON_INTERPRET
# when it is first imported (its own tl.* helpers are compiled or interpreted from then on). Switch it
# on here so that the forced-Triton path (the tests) works on CPU-only machines.
if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # the torch path still works
    HAS_TRITON = False
try:  # programmatic dependent launch (Hopper on; see pdl_opts)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:
    HAS_PDL = False
try:  # Gluon: Triton with explicit layouts, for the Hopper wgmma kernel. Its API still moves between
    # releases: the kernel ran with triton 3.6 and compiles with 3.8; older ones use the other kernels.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 6)
except ImportError:  # the other kernels serve every shape
    HAS_GLUON = False


# ---------------------------------------------------------------------------------------------
# Which path runs
# ---------------------------------------------------------------------------------------------

BACKENDS = ("auto", "torch", "triton")
KERNELS = (None, "mma", "gemv", "wgmma", "tiled", "dequant")
_choice = {"backend": os.environ.get("QERL_FP4_BACKEND", "auto"), "kernel": None,
           "pdl": os.environ.get("QERL_PDL", "1") != "0"}
if _choice["backend"] not in BACKENDS:  # a typo would otherwise act as "auto"
    raise ValueError(f"QERL_FP4_BACKEND={_choice['backend']!r}: use one of {BACKENDS}")


def set_backend(name="auto", kernel=None):
    """"auto": Triton on CUDA tensors, torch elsewhere. "triton": always Triton (on CPU tensors through
    the interpreter, slow: for tests). "torch": dequantize + matmul. `kernel` pins the Triton kernel
    ("mma", "gemv", "wgmma", "tiled", "dequant") instead of the per-shape table; None uses the table."""
    if name not in BACKENDS or kernel not in KERNELS:
        raise ValueError(f"backend must be one of {BACKENDS} and kernel one of {KERNELS}, got {name!r}, {kernel!r}")
    _choice["backend"], _choice["kernel"] = name, kernel


@contextlib.contextmanager
def backend(name, kernel=None):
    """with fp4_gemm.backend("triton", kernel="gemv"): ... — restores the previous choice on exit."""
    old = dict(_choice)
    set_backend(name, kernel)
    try:
        yield
    finally:
        _choice.update(old)


def _use_triton(x):
    name = _choice["backend"]
    if name == "torch":
        return False
    if name == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend 'triton' forced but triton is not installed")
        return True
    return HAS_TRITON and x.is_cuda


# ---------------------------------------------------------------------------------------------
# The torch path (reference semantics; CPU)
# ---------------------------------------------------------------------------------------------

def dequantize(packed, scale, global_scale, dtype=torch.float32):
    """(N, K) weight in `dtype` from the three stored tensors (global_scale (1,) or (N,)): nvfp4.dequantize's
    float32 arithmetic, the reference the Triton dequant kernel matches bit for bit."""
    return nvfp4.dequantize(nvfp4.NVFP4Tensor(packed, scale, global_scale), dtype)


def _torch_linear(x2, packed, scale, gs, bias):
    w = dequantize(packed, scale, gs, x2.dtype)  # (N, K), dropped on return
    y = x2 @ w.t()  # (M, N)
    return y + bias.to(y.dtype) if bias is not None else y


def _torch_dx(g2, packed, scale, gs):
    return g2 @ dequantize(packed, scale, gs, g2.dtype)  # (M, K)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

if HAS_TRITON:
    # One PTX block per 4 packed bytes (a 32-bit register q = b3 b2 b1 b0): `prmt` puts b0, b1 in the
    # high bytes of the two 16-bit halves, so the high nibbles sit at bits 12-15 / 28-31; a mask keeps
    # each sign bit, a shift moves e e m under the target's exponent, and one packed multiply by the
    # block scale (a pair, pre-adjusted by a power of two) finishes. `shl 4` brings the low nibbles up.
    # Outputs: $0,$1 = low nibbles of b0..b3, $2,$3 = high nibbles; inputs: $4 = the bytes, $5 = the
    # scales of b0, b1 and $6 those of b2, b3 (which 4 bytes an instance gets depends on the layout
    # Triton picks, so each byte brings its own scale).
    def _e2m1_asm(shift, mag_mask, mul):
        steps = []
        for dst, src, sc in (("$2", "a", "$5"), ("$3", "b", "$6"), ("$0", "c", "$5"), ("$1", "d", "$6")):
            steps.append(f"shr.b32 t, {src}, {shift}; and.b32 t, t, {mag_mask}; and.b32 u, {src}, 0x80008000; "
                         f"or.b32 t, t, u; {mul} {dst}, t, {sc};")
        return ("{ .reg .b32 a, b, c, d, t, u; prmt.b32 a, $4, 0, 0x1404; prmt.b32 b, $4, 0, 0x3424; "
                "shl.b32 c, a, 4; shl.b32 d, b, 4; " + " ".join(steps) + " }")

    _ASM_BF16: tl.constexpr = tl.constexpr(_e2m1_asm(6, "0x01C001C0", "mul.rn.bf16x2"))  # value * 2^-126
    _ASM_F16: tl.constexpr = tl.constexpr(_e2m1_asm(3, "0x0E000E00", "mul.rn.f16x2"))  # value * 2^-14

    # The GEMV's decode works on one 32-bit word q of 8 codes (k0..k7 = lo b0, hi b0, ..., hi b3) and
    # emits float16 pairs worth e2m1 * 2^-14 (the GEMV converts them to fp32 and applies the block scale
    # after summing the block). With h = q & 0xF0F0F0F0 the high nibbles are isolated, so
    # (h | h >> 3) & 0x8E008E00 keeps each sign bit and drops e e m under float16's exponent in one
    # shift and one LOP3: nothing else lands on those bits. `shl 8` serves the other byte of each half,
    # and l = (q << 4) & 0xF0F0F0F0 the low nibbles. Outputs: $0 = (k3, k7), $1 = (k1, k5),
    # $2 = (k2, k6), $3 = (k0, k4) as (low half, high half); input $4 = q.
    def _e2m1_word_asm():
        steps = []
        for dst, src in (("$0", "h"), ("$1", "h2"), ("$2", "l"), ("$3", "l2")):
            steps.append(f"shr.b32 t, {src}, 3; or.b32 t, t, {src}; and.b32 {dst}, t, 0x8E008E00;")
        return ("{ .reg .b32 h, h2, l, l2, t; and.b32 h, $4, 0xF0F0F0F0; shl.b32 l, $4, 4; "
                "and.b32 l, l, 0xF0F0F0F0; shl.b32 h2, h, 8; shl.b32 l2, l, 8; " + " ".join(steps) + " }")

    _ASM_WORD: tl.constexpr = tl.constexpr(_e2m1_word_asm())

    # Programmatic dependent launch (pdl_opts): a kernel launched with it may be scheduled before the
    # kernel ahead of it in the stream has finished, as that one's programs exit, so launch latency and
    # tail overlap. It must then wait (griddepcontrol.wait) before it reads memory that earlier kernels
    # write or writes memory that they read; the kernels here wait before any such access, on every
    # path, so each still finishes after all those before it, as in plain stream order. Reading what the
    # kernel before does not write may come first: rollout.py's small kernels load their LoRA B's and
    # norm weights before the wait, and the mma kernel, for decode, its first codes, which then overlaps
    # those loads with the kernel before. (Until the wait returns, even what the kernel before wrote
    # and then exited may not be visible yet.)
    @triton.jit
    def pdl_wait(PDL: tl.constexpr):
        if PDL:
            gdc_wait()

    # The kernel after this one may launch once every program of this one has called this (or exited),
    # instead of when they have all exited. The GEMMs call it after their k loop: the next kernel's
    # launch then overlaps their split-K epilogue, and as it still waits before reading their output,
    # nothing else changes. 0.8% off a decode step at 1 and 8 rows, none at 64 (results/rollout_h200.md,
    # session 15). Which of rollout.py's small kernels call it first thing, and what that measured, is
    # in rollout.py's docstring.
    @triton.jit
    def pdl_launch_next(PDL: tl.constexpr):
        if PDL:
            gdc_launch_dependents()

    @triton.jit
    def _e4m3_to_f32(b, factor: tl.constexpr = 256.0):
        """uint8 E4M3 bits → float32 values * factor / 256 (exact): as float16 bits shifted left by 7
        they read value * 2^-8."""
        b = b.to(tl.uint16)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * factor

    @triton.jit
    def _e2m1_to_f32(c):
        """E2M1 codes (uint16, 0..15) → float32 e2m1 * 2^-14 (exact, via float16 bits; 0.5 is subnormal)."""
        h = ((c & 0x7) << 9) | ((c & 0x8) << 12)
        return h.to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _w_pairs(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, DTYPE: tl.constexpr):
        """W[rows, k0:k0+BLOCK_K] as exact e2m1 * scale * 2^-8 in DTYPE, split by parity, as stored:
        (lo, hi), each (BLOCK_N, BLOCK_K/2), lo[:, j] = W[:, k0 + 2j] and hi[:, j] = W[:, k0 + 2j + 1]."""
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
        if USE_ASM:
            if DTYPE == tl.bfloat16:  # e2m1 * 2^-126 times scale * 2^118
                sa = _e4m3_to_f32(sb, 8.507059173023462e37).to(tl.bfloat16)[:, :, None]  # (BN, BK/16, 1)
                lo, hi = tl.inline_asm_elementwise(_ASM_BF16, "=r,=r,=r,=r,r,r,r", [p, sa],
                                                   dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:  # e2m1 * 2^-14 times scale * 2^6
                sa = _e4m3_to_f32(sb, 16384.0).to(tl.float16)[:, :, None]
                lo, hi = tl.inline_asm_elementwise(_ASM_F16, "=r,=r,=r,=r,r,r,r", [p, sa],
                                                   dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
        else:
            s = _e4m3_to_f32(sb, 16384.0)[:, :, None]  # (BN, BK/16, 1): scale * 2^6
            c = p.to(tl.uint16)
            lo = _e2m1_to_f32(c & 0xF) * s  # (BN, BK/16, 8) codes of even k
            hi = _e2m1_to_f32(c >> 4) * s  # odd k
        lo = tl.reshape(lo, (BLOCK_N, BLOCK_K // 2)).to(DTYPE)
        hi = tl.reshape(hi, (BLOCK_N, BLOCK_K // 2)).to(DTYPE)
        return lo, hi

    @triton.jit
    def _w_tile(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, DTYPE: tl.constexpr):
        """W[rows, k0:k0+BLOCK_K] in natural order: (BLOCK_N, BLOCK_K)."""
        lo, hi = _w_pairs(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N, BLOCK_K, EVEN_K, USE_ASM, DTYPE)
        return tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))  # k = 2 * byte + nibble

    @triton.jit
    def _x_pairs(x_rows, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, X16: tl.constexpr,
                 X_IS_BF16: tl.constexpr):
        """x[:, k0 + 2j] and x[:, k0 + 2j + 1] in fp32, each (BM, BLOCK_K/2). For 16-bit x one 32-bit
        load fetches a pair, so the loads stay wide and the split is two bit operations."""
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        if X16:
            ptrs = x_rows.to(tl.pointer_type(tl.uint32)) + kb[None, :]
            if EVEN_K:
                xw = tl.load(ptrs)  # (BM, BK/2), x[2j] in the low half
            else:
                xw = tl.load(ptrs, mask=kb[None, :] < K // 2, other=0)
            if X_IS_BF16:  # bf16 → fp32 is a 16-bit shift
                xe, xo = _lo_f32(xw), _hi_f32(xw)
            else:
                xe, xo = _f16lo(xw), _f16hi(xw)
        else:
            ke = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            if EVEN_K:
                xe = tl.load(x_rows + ke[None, :]).to(tl.float32)
                xo = tl.load(x_rows + ke[None, :] + 1).to(tl.float32)
            else:
                xe = tl.load(x_rows + ke[None, :], mask=ke[None, :] < K, other=0.0).to(tl.float32)
                xo = tl.load(x_rows + ke[None, :] + 1, mask=ke[None, :] < K, other=0.0).to(tl.float32)
        return xe, xo

    @triton.jit
    def _scale_bias(acc, rows, gs_ptr, bias_ptr, GS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr):
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
    def _finish(acc, offs_m, offs_n, pid_k, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym,
                SPLIT_K: tl.constexpr, GS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr):
        """acc (BM, BN) fp32 sums of x * (W * g / 256): scale by 256/g, add bias, store (or store the
        split-K partial for _splitk_reduce)."""
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        if SPLIT_K > 1:
            ptrs = part_ptr + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :]
            tl.store(ptrs, acc, mask=mask)
        else:
            acc = _scale_bias(acc, (offs_n % N)[None, :], gs_ptr, bias_ptr, GS_PER_ROW, HAS_BIAS)
            ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
            tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _f16lo(w):
        return (w & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _f16hi(w):
        return (w >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _hi_f32(w):  # the high bf16 of a 32-bit pair, as fp32
        return (w & 0xFFFF0000).to(tl.float32, bitcast=True)

    @triton.jit
    def _lo_f32(w):  # the low bf16 of a 32-bit pair, as fp32
        return (w << 16).to(tl.float32, bitcast=True)

    @triton.jit
    def _gemv_kernel(x_ptr, wp_ptr, ws_ptr, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_ym,
                     stride_wn, stride_sn, k_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     SPLIT_K: tl.constexpr, GS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                     EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, X16: tl.constexpr, X_IS_BF16: tl.constexpr):
        """Decode GEMV: program (n, m, s) owns BLOCK_N weight rows, one row of x and one K split (fp32
        FMAs, no tensor cores). On the GPU (USE_ASM) the codes are read as 32-bit words of 8 and a
        (BN, BK/16) tile of block partials keeps every decoded value in the thread that decoded it: no
        layout change, one reduction at the end. Elsewhere even and odd k are kept apart the same way.
        (Measured on the H200: prefetching the next step's loads into registers, or 2-4 rows of x per
        program, made this kernel slower, so neither is done.)"""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_n % N  # past-the-end rows read row 0..: valid memory, never stored
        x_rows = x_ptr + pid_m.to(tl.int64) * stride_xm + tl.zeros((1, 1), tl.int32)  # (1, 1)
        k_lo = pid_k * k_split
        if USE_ASM:  # the GPU: 32-bit words of 8 codes, the PTX decode, fp32 FMAs
            acc = tl.zeros((BLOCK_N, BLOCK_K // 16), tl.float32)  # one partial per 16-value block
            wq_ptr = wp_ptr.to(tl.pointer_type(tl.uint32))
            bw = tl.arange(0, BLOCK_K // 16)[None, :, None] * 2 + tl.arange(0, 2)[None, None, :]  # (1, BK/16, 2)
            q_ptrs = wq_ptr + rows[:, None, None] * (stride_wn // 4) + bw  # (BN, BK/16, 2) words
            s_ptrs = ws_ptr + rows[:, None] * stride_sn + tl.arange(0, BLOCK_K // 16)[None, :]  # (BN, BK/16)
            x_ptrs = x_rows[:, :, None].to(tl.pointer_type(tl.uint32)) + 4 * bw  # (1, BK/16, 2) x pairs
            for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
                kw = tl.multiple_of(k0 // 8, 4)
                if EVEN_K:
                    q = tl.load(q_ptrs + kw)
                    sb = tl.load(s_ptrs + k0 // 16)
                else:
                    q = tl.load(q_ptrs + kw, mask=kw + bw < K // 8, other=0)
                    sb = tl.load(s_ptrs + k0 // 16, mask=k0 // 16 + tl.arange(0, BLOCK_K // 16)[None, :] < K // 16,
                                 other=0)
                p37, p15, p26, p04 = tl.inline_asm_elementwise(
                    _ASM_WORD, "=r,=r,=r,=r,r", [q], dtype=(tl.uint32, tl.uint32, tl.uint32, tl.uint32),
                    is_pure=True, pack=1)  # float16 pairs (k3, k7), (k1, k5), (k2, k6), (k0, k4) of each word
                xp = x_ptrs + 4 * kw
                if X16 and X_IS_BF16:  # (x[k], x[k+1]) as one 32-bit load; bf16 → fp32 by shifts
                    if EVEN_K:
                        x01 = tl.load(xp)
                        x23 = tl.load(xp + 1)
                        x45 = tl.load(xp + 2)
                        x67 = tl.load(xp + 3)
                    else:
                        xm = kw + bw < K // 8
                        x01 = tl.load(xp, mask=xm, other=0)
                        x23 = tl.load(xp + 1, mask=xm, other=0)
                        x45 = tl.load(xp + 2, mask=xm, other=0)
                        x67 = tl.load(xp + 3, mask=xm, other=0)
                    x0, x1, x2, x3 = _lo_f32(x01), _hi_f32(x01), _lo_f32(x23), _hi_f32(x23)
                    x4, x5, x6, x7 = _lo_f32(x45), _hi_f32(x45), _lo_f32(x67), _hi_f32(x67)
                else:
                    xe = x_rows[:, :, None] + 8 * (kw + bw)  # (1, BK/16, 2) first k of each word
                    xm = kw + bw < K // 8
                    x0 = tl.load(xe, mask=xm, other=0.0).to(tl.float32)
                    x1 = tl.load(xe + 1, mask=xm, other=0.0).to(tl.float32)
                    x2 = tl.load(xe + 2, mask=xm, other=0.0).to(tl.float32)
                    x3 = tl.load(xe + 3, mask=xm, other=0.0).to(tl.float32)
                    x4 = tl.load(xe + 4, mask=xm, other=0.0).to(tl.float32)
                    x5 = tl.load(xe + 5, mask=xm, other=0.0).to(tl.float32)
                    x6 = tl.load(xe + 6, mask=xm, other=0.0).to(tl.float32)
                    x7 = tl.load(xe + 7, mask=xm, other=0.0).to(tl.float32)
                # one fp32 multiply-add chain per word (left to right, so each + fuses into an FFMA)
                part = _f16lo(p04) * x0 + _f16lo(p15) * x1 + _f16lo(p26) * x2 + _f16lo(p37) * x3 + \
                    _f16hi(p04) * x4 + _f16hi(p15) * x5 + _f16hi(p26) * x6 + _f16hi(p37) * x7  # (BN, BK/16, 2)
                acc += tl.sum(part, axis=2) * _e4m3_to_f32(sb, 16384.0)  # (e2m1 2^-14)(s 2^6) = e2m1 s 2^-8
            out = tl.sum(acc, axis=1)[None, :]  # (1, BN)
        else:
            acc_e = tl.zeros((BLOCK_N, BLOCK_K // 2), tl.float32)
            acc_o = tl.zeros((BLOCK_N, BLOCK_K // 2), tl.float32)
            for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
                lo, hi = _w_pairs(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N, BLOCK_K, EVEN_K,
                                  False, tl.float32)  # (BN, BK/2) each
                xe, xo = _x_pairs(x_rows, k0, K, BLOCK_K, EVEN_K, X16, X_IS_BF16)  # (1, BK/2) each
                acc_e += lo * xe
                acc_o += hi * xo
            out = tl.sum(acc_e + acc_o, axis=1)[None, :]  # (1, BN)
        offs_m = pid_m + tl.arange(0, 1)
        _finish(out, offs_m, offs_n, pid_k, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym,
                SPLIT_K, GS_PER_ROW, HAS_BIAS)

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
                      HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, DTYPE: tl.constexpr,
                      PRECISION: tl.constexpr):
        """Fused dequantize + tl.dot: (BM, BN) output tiles, the decoded weight tile is the MMA's right
        operand. (Measured on the H200 and dropped: the swapped form W x^T with the weight as the left
        operand, and two dots over the even and odd k instead of interleaving the decoded halves.)"""
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
            w = _w_tile(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N, BLOCK_K, EVEN_K, USE_ASM,
                        DTYPE)  # (BN, BK)
            kk = k0 + tl.arange(0, BLOCK_K)
            if EVEN_K:
                x = tl.load(x_rows + kk[None, :])  # (BM, BK)
            else:
                x = tl.load(x_rows + kk[None, :], mask=kk[None, :] < K, other=0.0)
            acc = tl.dot(x.to(DTYPE), tl.trans(w), acc, input_precision=PRECISION)  # (BM, BN)
        _finish(acc, offs_m, offs_n, pid_k, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym,
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
        acc = _scale_bias(acc, n, gs_ptr, bias_ptr, GS_PER_ROW, HAS_BIAS)  # (n = offs % N is in range)
        tl.store(y_ptr + m.to(tl.int64) * stride_ym + n, acc.to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _tiled_dx_kernel(g_ptr, wp_ptr, ws_ptr, gs_ptr, dx_ptr, M, N, K, stride_gm, stride_dm,
                         stride_wn, stride_sn,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, GS_PER_ROW: tl.constexpr, EVEN_N: tl.constexpr,
                         EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
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
            w = _w_tile(wp_ptr, ws_ptr, stride_wn, stride_sn, nn_ % N, pid_k * BLOCK_K, K, BLOCK_N, BLOCK_K, EVEN_K, USE_ASM, DTYPE)
            acc = tl.dot(g.to(DTYPE), w, acc, input_precision=PRECISION)  # (BM, BK)
        if not GS_PER_ROW:
            acc = acc * (256.0 / tl.load(gs_ptr))
        offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        mask = (offs_m[:, None] < M) & (offs_k[None, :] < K)
        tl.store(dx_ptr + offs_m[:, None].to(tl.int64) * stride_dm + offs_k[None, :],
                 acc.to(dx_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dequant_kernel(wp_ptr, ws_ptr, gs_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GS_PER_ROW: tl.constexpr):
        """W (N, K) in out's dtype, with nvfp4.dequantize's float32 arithmetic (so bit-identical to it):
        e2m1 * (scale / g), one rounding to the output dtype."""
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = offs_n % N
        k0 = tl.program_id(1) * BLOCK_K
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        p = tl.load(wp_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=kb[None, :] < K // 2, other=0)
        sb = tl.load(ws_ptr + rows[:, None] * (K // 16) + ks[None, :], mask=ks[None, :] < K // 16, other=0)
        if GS_PER_ROW:
            g = tl.load(gs_ptr + rows)[:, None]
        else:
            g = tl.load(gs_ptr)
        bs = tl.math.div_rn(_e4m3_to_f32(sb), g)  # (BN, BK/16), IEEE division as torch's
        c = tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 8)).to(tl.uint16)
        lo = (_e2m1_to_f32(c & 0xF) * 16384.0) * bs[:, :, None]  # (BN, BK/16, 8) even k, exact e2m1 * bs
        hi = (_e2m1_to_f32(c >> 4) * 16384.0) * bs[:, :, None]  # odd k
        w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
        tl.store(out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :], w.to(out_ptr.dtype.element_ty),
                 mask=mask)


    # ---- a small dense product riding along: x (a few rows) @ A^T for a LoRA A ---------------------

    @triton.jit
    def _small_part(x_ptr, a_ptr, out_ptr, part_ptr, lock_ptr, M, K, SR, stride_xm, pid_m, tile, chunk, k_split,
                    lock, SPLIT: tl.constexpr, SPLIT_PAD: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr):
        """One program of out (M, SR) = x (M, K) @ A^T (SR, K): rows 16·pid_m.., columns 16·tile.., over the
        K chunk `chunk` (k_split wide; an empty chunk adds zeros). With SPLIT chunks a tile, each program
        stores an fp32 partial; the last to arrive (an atomic ticket on counter `lock`, as the mma
        kernel's split-K) sums them in chunk order (deterministic) and writes `out` in its dtype.
        F32: dot in fp32 (fp32 x, or the interpreter, which multiplies 16-bit dot operands as raw bits)."""
        rows = pid_m * 16 + tl.arange(0, 16)
        cols = tile * 16 + tl.arange(0, 16)
        rm = rows < M
        cm = cols < SR
        acc = tl.zeros((16, 16), tl.float32)
        k_lo = chunk * k_split
        for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BK):
            k = k0 + tl.arange(0, BK)
            km = k < K
            xt = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            at = tl.load(a_ptr + cols[:, None] * K + k[None, :], mask=cm[:, None] & km[None, :], other=0.0)
            if F32:
                acc = tl.dot(xt.to(tl.float32), tl.trans(at.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xt, tl.trans(at), acc)  # (16, 16)
        out = out_ptr + rows[:, None] * SR + cols[None, :]
        mask = rm[:, None] & cm[None, :]
        if SPLIT == 1:
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            part = part_ptr + (rows[:, None] * SR + cols[None, :])  # (16, 16); chunk c at + c·M·SR
            tl.store(part + chunk * M * SR, acc, mask=mask)
            tl.debug_barrier()  # the whole partial is written before the ticket is taken
            if tl.atomic_add(lock_ptr + lock, 1, sem="acq_rel", scope="gpu") == SPLIT - 1:
                ss = tl.arange(0, SPLIT_PAD)[:, None, None]
                p = tl.load(part[None] + ss * M * SR, mask=(ss < SPLIT) & mask[None], other=0.0, cache_modifier=".cg")
                tl.store(out, tl.sum(p, axis=0).to(out_ptr.dtype.element_ty), mask=mask)
                tl.atomic_xchg(lock_ptr + lock, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _small_kernel(x_ptr, a_ptr, out_ptr, part_ptr, lock_ptr, M, K, SR, stride_xm, k_split, SPLIT: tl.constexpr,
                      SPLIT_PAD: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr):
        """Program (column tile, K chunk, row tile) of small_linear."""
        pdl_wait(PDL)
        tile = tl.program_id(0)
        pid_m = tl.program_id(2)
        _small_part(x_ptr, a_ptr, out_ptr, part_ptr, lock_ptr, M, K, SR, stride_xm, pid_m, tile, tl.program_id(1),
                    k_split, pid_m * tl.num_programs(0) + tile, SPLIT, SPLIT_PAD, BK, F32)


    # ---- x in the wgmma kernel's K order ----------------------------------------------------------

    @triton.jit
    def _k_order_kernel(x_ptr, out_ptr, M, K, stride_xm, stride_xk, BK: tl.constexpr, BLOCK: tl.constexpr,
                        PDL: tl.constexpr):
        """Program p < cdiv(K, BLOCK) · M: out[m, k] = x[m, wgmma_k_order[k]] for BLOCK columns k of row m
        (the same formula as wgmma_k_order, without an index tensor). x was just written by the kernel
        before: the gathers hit L2."""
        pdl_wait(PDL)
        blocks = tl.cdiv(K, BLOCK)
        p = tl.program_id(0)
        m = (p // blocks).to(tl.int64)
        k = (p % blocks) * BLOCK + tl.arange(0, BLOCK)
        col = k % BK
        c, b, t, h = col // 16, (col // 8) % 2, (col // 2) % 4, col % 2
        phys = (BK // 4) * t + 8 * (c // 2) + 3 - (2 * (c % 2) + b) + 4 * h
        ok = k < K
        tl.store(out_ptr + m * K + k, tl.load(x_ptr + m * stride_xm + ((k - col) + phys) * stride_xk, mask=ok), mask=ok)

    @triton.jit
    def k_ordered_tile(v, R: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
        """A tile v (R, C) of rows of x, C a multiple of BK and starting at a multiple of BK, with its columns
        in the wgmma kernel's K order (wgmma_k_order), for a kernel that stores x for the warp-specialized
        wgmma kernel itself (x_k_order): a k-step's column phys = (BK/4) t + 8 j + 4 h + r goes to column
        16 (2 j + a) + 8 b + 2 t + h with 2 a + b = 3 - r. Moves registers only (through shared memory),
        so the store stays contiguous."""
        v = tl.flip(tl.reshape(v, (R, C // BK, 4, BK // 32, 2, 4)), 5)  # (row, step, t, j, h, 2a + b)
        v = tl.permute(tl.reshape(v, (R, C // BK, 4, BK // 32, 2, 2, 2)), (0, 1, 3, 5, 6, 2, 4))  # (.., j, a, b, t, h)
        return tl.reshape(v, (R, C))

    # ---- the tensor-core GEMV (up to 8 rows of x a program): Marlin's idea as one PTX block ----
    #
    # mma.sync m16n8k16 multiplies a 16 x 16 tile A (weight rows x k) by a 16 x 8 tile B (k x tokens) with
    # fp32 accumulation. Its operands live in registers spread over the warp: lane = 4 g + t holds, of A,
    # rows g and g + 8 at columns (2t, 2t+1) and (2t+8, 2t+9); of B, token g at rows (2t, 2t+1) and
    # (2t+8, 2t+9); of the result, rows g and g + 8 at tokens 2t and 2t + 1. Which physical k a column
    # stands for is ours to choose, as long as A and B agree. So each lane decodes contiguous pieces of
    # the rows it loads (row g and row g + 8, 64 codes each per k-step of 256) and loads x at the same
    # k: its decoded pairs go straight into the MMA, nothing moves between lanes. Rows of x beyond M
    # (all but one at decode) are zeros: the MMA is 8x wider than needed, but tensor-core time is not
    # what bounds this kernel; decoding is.
    #
    # The word decode both tensor-core kernels share: a 32-bit word q holds codes k0..k7 (4 bits each,
    # k0 lowest) and becomes 4 registers of 2 values, (k3, k7), (k2, k6), (k1, k5), (k0, k4) (low half,
    # high half), each value exactly e2m1 * 2^-126 (bf16) or * 2^-14 (f16) before the multiply by the
    # scale pair. bf16: isolate one code per 16-bit half (and), then one integer multiply copies it to
    # two places at once: by 2^6 + 2^12 for a code at bits 0-3 (e e m lands on bits 8..6, under bf16's
    # exponent, the sign on bit 15; the two copies never overlap, so nothing carries), by 2^2 + 2^8 for
    # a code at bits 4-7; a final and keeps those 4 bits. k2, k3, k6, k7 first move down a byte (shr).
    # That is 9 ALU instructions a word (two ands per code pair, and the shift) and 4 multiplies on the
    # FMA pipe; the f16 decode moves each pair's nibbles to bits 15..12 and 31..28 (shl), keeps the
    # sign and drops e e m three bits lower (and, shr, or + and): f16's 5-bit exponent puts the two
    # copies one bit apart, where the multiply would carry.
    def _word_decode_ptx(word, outs, scale, f16):
        """PTX decoding register `word` into registers outs = (k3,k7), (k2,k6), (k1,k5), (k0,k4), times
        the pair in `scale` (with scratch registers n, q8 declared by the caller)."""
        if f16:
            lines = []
            for out, sl in zip(outs, (0, 4, 8, 12)):
                src = word
                if sl:
                    lines.append(f"shl.b32 n, {word}, {sl};")
                    src = "n"
                lines.append(f"and.b32 q8, {src}, 0xF000F000; shr.b32 n, q8, 3; or.b32 n, n, q8; "
                             f"and.b32 n, n, 0x8E008E00; mul.rn.f16x2 {out}, n, {scale};")
            return " ".join(lines)
        lines = [f"shr.b32 q8, {word}, 8;"]
        for out, src, mask, mult in zip(outs, ("q8", "q8", word, word), ("0x00F000F0", "0x000F000F") * 2,
                                        (260, 4160) * 2):
            lines.append(f"and.b32 n, {src}, {mask}; mul.lo.u32 n, n, {mult}; and.b32 n, n, 0x81C081C0; "
                         f"mul.rn.bf16x2 {out}, n, {scale};")
        return " ".join(lines)

    # One PTX block per half k-step (4 words of each of the two rows):
    #   scales: two E4M3 bytes per row (the blocks of words 0-1 and 2-3) → a pair each, times a power
    #           of two by bit moves and a mul (value * 2^118 in bf16, * 2^6 in f16);
    #   codes:  word q (8 codes, k = 8w + 0..7) → 4 registers of 2 values, (k3, k7), (k2, k6), (k1, k5),
    #           (k0, k4) (_word_decode_ptx), times the scale pair: exact e2m1 * s * 2^-8;
    #   x:      the lane's 8 x values of the word paired the same way (prmt);
    #   MMA:    two per word, (k3,k7 | k2,k6) and (k1,k5 | k0,k4), chained into one fp32 accumulator.
    # Operands: $0-$3 accumulator out; $4-$7 the 4 words of row g, $8-$11 of row g + 8; $12 / $13 the
    # rows' 4 scale bytes (this half uses bytes 0, 1 or 2, 3); $14-$29 x pairs (x0,x1), (x2,x3), (x4,x5),
    # (x6,x7) of the 4 words; $30-$33 accumulator in.
    def _mma_asm(f16, half):
        if f16:  # scale: s * 2^-8 as f16 bits, times 2^14
            ty, sshift, smask, mul, cst = "f16", 7, "0x3F803F80", "mul.rn.f16x2", "0x74007400"
        else:  # scale: s * 2^-120 as bf16 bits, times 2^119 twice
            ty, sshift, smask, mul, cst = "bf16", 4, "0x07F007F0", "mul.rn.bf16x2", "0x7B007B00"
        regs = [f"s{r}{b}" for r in "tb" for b in "01"] + [f"w{r}{w}{p}" for r in "tb" for w in range(4) for p in range(4)]
        regs += [f"x{w}{p}" for w in range(4) for p in range(4)] + ["c", "u", "v", "n", "q8"]
        lines = [".reg .b32 " + ", ".join(regs) + ";", f"mov.b32 c, {cst};"]
        for r, src in (("t", "$12"), ("b", "$13")):  # bytes (2 half, 2 half + 1) → u = b_lo | b_hi << 16
            lines += [f"prmt.b32 u, {src}, 0, {'0x4342' if half else '0x4140'};", f"shl.b32 v, u, {sshift};",
                      f"and.b32 v, v, {smask};", "shl.b32 u, u, 8;", "and.b32 u, u, 0x80008000;", "or.b32 u, u, v;",
                      f"{mul} u, u, c;"] + ([] if f16 else [f"{mul} u, u, c;"])
            lines += [f"prmt.b32 s{r}0, u, 0, 0x1010;", f"prmt.b32 s{r}1, u, 0, 0x3232;"]
        for r, base in (("t", 4), ("b", 8)):
            for w in range(4):  # p: (k3,k7), (k2,k6), (k1,k5), (k0,k4)
                outs = [f"w{r}{w}{p}" for p in range(4)]
                lines.append(_word_decode_ptx(f"${base + w}", outs, f"s{r}{w // 2}", f16))
        for w in range(4):
            x01, x23, x45, x67 = (f"${14 + 4 * w + j}" for j in range(4))
            lines += [f"prmt.b32 x{w}0, {x23}, {x67}, 0x7632;", f"prmt.b32 x{w}1, {x23}, {x67}, 0x5410;",
                      f"prmt.b32 x{w}2, {x01}, {x45}, 0x7632;", f"prmt.b32 x{w}3, {x01}, {x45}, 0x5410;"]
        acc_in = "{$30, $31, $32, $33}"
        for w in range(4):
            for p0 in (0, 2):
                a = f"{{wt{w}{p0}, wb{w}{p0}, wt{w}{p0 + 1}, wb{w}{p0 + 1}}}"
                lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{$0, $1, $2, $3}}, {a}, "
                             f"{{x{w}{p0}, x{w}{p0 + 1}}}, {acc_in};")
                acc_in = "{$0, $1, $2, $3}"
        return "{ " + " ".join(lines) + " }"

    # indexed by 2 * F16 + HALF inside the kernel (triton 3.6 will not pass a string as an argument)
    _ASM_MMA: tl.constexpr = tl.constexpr(tuple(_mma_asm(f16, half) for f16 in (False, True) for half in (0, 1)))
    _MMA_CONSTRAINTS: tl.constexpr = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 26) + ",f,f,f,f")

    @triton.jit
    def _mma_rows_reference(q, s, xv, HALF: tl.constexpr, NUM_WARPS: tl.constexpr, ROW_TILES: tl.constexpr):
        """One row of each lane's pair (g or g + 8): (R, L) sums at tokens 2t and 2t + 1."""
        s16 = tl.reshape(s.to(tl.uint16), (ROW_TILES, 32 * NUM_WARPS, 2, 2))  # (R, L, half, block)
        s_lo, s_hi = tl.split(s16)  # (R, L, 2) each: byte 2 * half + 0 / + 1
        lo_h0, lo_h1 = tl.split(s_lo)
        hi_h0, hi_h1 = tl.split(s_hi)
        if HALF:
            sc = tl.join(_e4m3_to_f32(lo_h1, 16384.0), _e4m3_to_f32(hi_h1, 16384.0))  # (R, L, 2): * 2^6
        else:
            sc = tl.join(_e4m3_to_f32(lo_h0, 16384.0), _e4m3_to_f32(hi_h0, 16384.0))
        sc = tl.reshape(tl.broadcast_to(tl.reshape(sc, (ROW_TILES, 32 * NUM_WARPS, 2, 1)),
                                        (ROW_TILES, 32 * NUM_WARPS, 2, 2)), (ROW_TILES, 32 * NUM_WARPS, 4, 1))
        i = tl.arange(0, 8)[None, None, None, :]
        wv = _e2m1_to_f32(((q[:, :, :, None] >> (4 * i)) & 0xF).to(tl.uint16)) * sc  # (R, L, 4, 8): k = 8 w + i
        wv = tl.reshape(wv, (ROW_TILES * NUM_WARPS, 8, 128))  # (tile, row g, k = 32 t + 8 w + i)
        xb = tl.reshape(tl.broadcast_to(xv[None, :, :, :], (ROW_TILES, NUM_WARPS, 8, 128)), (ROW_TILES * NUM_WARPS, 8, 128))
        p = tl.sum(wv[:, :, None, :] * xb[:, None, :, :], axis=3)  # (tile, row g, token)
        even, odd = tl.split(tl.reshape(p, (ROW_TILES, 8 * NUM_WARPS, 4, 2)))  # tokens 2t, 2t + 1
        return tl.reshape(even, (ROW_TILES, 32 * NUM_WARPS)), tl.reshape(odd, (ROW_TILES, 32 * NUM_WARPS))

    @triton.jit
    def _mma_half_reference(qt, qb, st, sb, xw0, xw1, xw2, xw3, HALF: tl.constexpr, NUM_WARPS: tl.constexpr,
                            ROW_TILES: tl.constexpr, F16: tl.constexpr):
        """What one PTX block adds to the accumulator, in plain Triton (for the interpreter): the same
        lane layout, the exchange between lanes done by reshapes. qt, qb (L, R, 4) words; st, sb (L, R, 4)
        scale bytes; xw.. (L, 1, 4) x pairs of each word. Returns (L, R, 4): rows g / g+8 at tokens 2t / 2t+1.
        (Worked in (R, L, 4) order inside.)"""
        qt, qb = tl.permute(qt, (1, 0, 2)), tl.permute(qb, (1, 0, 2))
        st, sb = tl.permute(st, (1, 0, 2)), tl.permute(sb, (1, 0, 2))
        xw0, xw1 = tl.permute(xw0, (1, 0, 2)), tl.permute(xw1, (1, 0, 2))
        xw2, xw3 = tl.permute(xw2, (1, 0, 2)), tl.permute(xw3, (1, 0, 2))
        x = tl.join(tl.join(xw0, xw2), tl.join(xw1, xw3))  # (1, L, pair, 2, 2): word w at flat index w
        x = tl.permute(tl.reshape(x, (1, 32 * NUM_WARPS, 4, 4)), (0, 1, 3, 2))  # (1, L, word, pair)
        if F16:
            xv = tl.join(_f16lo(x), _f16hi(x))
        else:
            xv = tl.join(_lo_f32(x), _hi_f32(x))  # (1, L, 4, 4, 2): x[8 w + 2 j + h] in fp32
        xv = tl.reshape(xv, (NUM_WARPS, 8, 128))  # (warp, token g, k of the lane's quad: 32 t + 8 w + i)
        top_even, top_odd = _mma_rows_reference(qt, st, xv, HALF, NUM_WARPS, ROW_TILES)
        bot_even, bot_odd = _mma_rows_reference(qb, sb, xv, HALF, NUM_WARPS, ROW_TILES)
        # [.., j] = (row g, token 2t), (g, 2t+1), (g+8, 2t), (g+8, 2t+1): join puts its pair on a new last axis
        out = tl.reshape(tl.join(tl.join(top_even, bot_even), tl.join(top_odd, bot_odd)),
                         (ROW_TILES, 32 * NUM_WARPS, 4))
        return tl.permute(out, (1, 0, 2))

    @triton.jit
    def _mma_half(acc, qt, qb, st, sb, xp, ok, ROW_TILES: tl.constexpr, NUM_WARPS: tl.constexpr,
                  HALF: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr):
        """Half a k-step: x for the lane's 4 words (ok: the lane's token exists and its k are before K),
        then the PTX block (or its plain-Triton model)."""
        L: tl.constexpr = 32 * NUM_WARPS
        j = tl.arange(0, 4)[None, None, :]
        xw0 = tl.load(xp + j, mask=ok, other=0)  # (L, 1, 4): the pairs (x0,x1) .. (x6,x7) of word 0
        xw1 = tl.load(xp + 4 + j, mask=ok, other=0)
        xw2 = tl.load(xp + 8 + j, mask=ok, other=0)
        xw3 = tl.load(xp + 12 + j, mask=ok, other=0)
        if USE_ASM:
            shape: tl.constexpr = (L, ROW_TILES, 4)
            args = [qt, qb, st, sb, tl.broadcast_to(xw0, shape), tl.broadcast_to(xw1, shape),
                    tl.broadcast_to(xw2, shape), tl.broadcast_to(xw3, shape), acc]
            acc = tl.inline_asm_elementwise(_ASM_MMA[2 * F16 + HALF], _MMA_CONSTRAINTS, args, dtype=tl.float32,
                                            is_pure=True, pack=4)
            return acc
        return acc + _mma_half_reference(qt, qb, st, sb, xw0, xw1, xw2, xw3, HALF, NUM_WARPS, ROW_TILES, F16)

    @triton.jit
    def _mma_loads(qt_ptrs, qb_ptrs, st_ptrs, sb_ptrs, k0, K, t, EVEN_K: tl.constexpr):
        """One k-step of 256's weight: the lane's words 0-3 and 4-7 of rows g and g + 8 (k = k0 + 64 t +
        8 w + i) and their 4 scale bytes. K is a multiple of 64, so a lane's 64 k are all before K or all
        past it (then they load as zeros); the masks are per lane, which keeps the loads 16-byte vectors
        in the lane layout."""
        kw = tl.multiple_of(k0 // 8, 32)  # (k0 is a multiple of 256): aligned vector loads
        ks = tl.multiple_of(k0 // 16, 16)
        if EVEN_K:
            return (tl.load(qt_ptrs + kw), tl.load(qt_ptrs + kw + 4), tl.load(qb_ptrs + kw), tl.load(qb_ptrs + kw + 4),
                    tl.load(st_ptrs + ks), tl.load(sb_ptrs + ks))
        k_in = k0 + 64 * t[:, None, None] < K  # (L, 1, 1)
        return (tl.load(qt_ptrs + kw, mask=k_in, other=0), tl.load(qt_ptrs + kw + 4, mask=k_in, other=0),
                tl.load(qb_ptrs + kw, mask=k_in, other=0), tl.load(qb_ptrs + kw + 4, mask=k_in, other=0),
                tl.load(st_ptrs + ks, mask=k_in, other=0), tl.load(sb_ptrs + ks, mask=k_in, other=0))

    @triton.jit
    def _mma_compute(acc, w, x_ptrs, x_ok, k0, K, t, ROW_TILES: tl.constexpr, NUM_WARPS: tl.constexpr,
                     EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr):
        """The k-step's MMAs on its loaded weight w (_mma_loads), with x loaded here."""
        qt0, qt1, qb0, qb1, st, sb = w
        xp = x_ptrs + tl.multiple_of(k0 // 2, 128)
        ok = x_ok if EVEN_K else x_ok & (k0 + 64 * t[:, None, None] < K)
        acc = _mma_half(acc, qt0, qb0, st, sb, xp, ok, ROW_TILES, NUM_WARPS, 0, USE_ASM, F16)
        return _mma_half(acc, qt1, qb1, st, sb, xp + 16, ok, ROW_TILES, NUM_WARPS, 1, USE_ASM, F16)

    @triton.jit
    def _mma_step(acc, qt_ptrs, qb_ptrs, st_ptrs, sb_ptrs, x_ptrs, x_ok, k0, K, t, ROW_TILES: tl.constexpr,
                  NUM_WARPS: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr):
        """One k-step of 256: its weight, x, and the MMAs."""
        w = _mma_loads(qt_ptrs, qb_ptrs, st_ptrs, sb_ptrs, k0, K, t, EVEN_K)
        return _mma_compute(acc, w, x_ptrs, x_ok, k0, K, t, ROW_TILES, NUM_WARPS, EVEN_K, USE_ASM, F16)

    @triton.jit
    def _mma_kernel(x_ptr, wp_ptr, ws_ptr, gs_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, stride_xm, stride_ym,
                    stride_wn, stride_sn, k_split, side_ptr, side_out_ptr, side_part_ptr, SR, n_w, side_k_split,
                    ROW_TILES: tl.constexpr, NUM_WARPS: tl.constexpr, SPLIT_K: tl.constexpr, GS_PER_ROW: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, F16: tl.constexpr,
                    SIDE_COLS: tl.constexpr, SIDE_SPLIT: tl.constexpr, SIDE_PAD: tl.constexpr, SIDE_F32: tl.constexpr,
                    W_EARLY: tl.constexpr, PDL: tl.constexpr):
        """Program (n, m, s): 16 * NUM_WARPS * ROW_TILES weight rows, x rows 8m..8m+7, K split s, k-steps
        of 256. Tensors are (lane, row tile, 4), the 4 contiguous on the last axis: Triton lays such a
        load out with its threads along the first axis that is not contiguous, one lane per index (16
        bytes each), which is the MMA's lane numbering, and the row tiles in each lane's registers. (With
        the row tiles first, Triton spread them over lanes too, per the compiled TTGIR: no PTX block would
        have seen its own lane's data with ROW_TILES > 1.)
        stride_wn is in 32-bit words, stride_xm in pairs of x, stride_sn in bytes.
        SIDE_COLS > 0 (M <= 8): programs n >= n_w compute the side product x @ side^T instead, SIDE_COLS
        programs a 16-column tile along axis 0 times SPLIT_K along axis 2, one K chunk each (_small_part).
        (Placed first along axis 0 instead, so that they start early, they made the launch slower.)"""
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        if SIDE_COLS > 0:
            if pid_n >= n_w:
                pdl_wait(PDL)
                e = pid_n - n_w
                tile = e // SIDE_COLS  # its ticket counter n_w + tile: the weight tiles' are m · programs + n < n_w
                _small_part(x_ptr, side_ptr, side_out_ptr, side_part_ptr, lock_ptr, M, K, SR, 2 * stride_xm, 0,
                            tile, (e % SIDE_COLS) * SPLIT_K + pid_k, side_k_split, n_w + tile, SIDE_SPLIT,
                            SIDE_PAD, 256, SIDE_F32)
                return
        L: tl.constexpr = 32 * NUM_WARPS
        lane = tl.arange(0, L)
        g = (lane % 32) // 4
        t = lane % 4
        tile = (lane // 32)[:, None] + tl.arange(0, ROW_TILES)[None, :] * NUM_WARPS  # (L, R)
        row = pid_n * (16 * NUM_WARPS * ROW_TILES) + tile * 16 + g[:, None]  # (L, R): row g of the lane's tile
        j = tl.arange(0, 4)[None, None, :]
        wq = wp_ptr.to(tl.pointer_type(tl.uint32))
        qt_ptrs = wq + ((row % N) * stride_wn + 8 * t[:, None])[:, :, None] + j  # (L, R, 4): words 0-3 of the lane
        qb_ptrs = wq + (((row + 8) % N) * stride_wn + 8 * t[:, None])[:, :, None] + j
        st_ptrs = ws_ptr + ((row % N) * stride_sn + 4 * t[:, None])[:, :, None] + j  # (L, R, 4) scale bytes
        sb_ptrs = ws_ptr + (((row + 8) % N) * stride_sn + 4 * t[:, None])[:, :, None] + j
        token = pid_m * 8 + g  # (L,) the lane's row of x (B's column)
        xq = x_ptr.to(tl.pointer_type(tl.uint32))
        x_ptrs = xq + (token.to(tl.int64) * stride_xm + 32 * t)[:, None, None]  # (L, 1, 1): the lane's first pair
        x_ok = (token < M)[:, None, None]
        acc = tl.zeros((L, ROW_TILES, 4), tl.float32)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        if not W_EARLY:
            pdl_wait(PDL)
        w0 = _mma_loads(qt_ptrs, qb_ptrs, st_ptrs, sb_ptrs, k_lo, K, t, False)  # the first k-step's weight
        if W_EARLY:  # (it loads while the kernel before finishes)
            pdl_wait(PDL)
        if k_lo < k_hi:
            acc = _mma_compute(acc, w0, x_ptrs, x_ok, k_lo, K, t, ROW_TILES, NUM_WARPS, False, USE_ASM, F16)
        for k0 in range(k_lo + 256, k_hi, 256):
            acc = _mma_step(acc, qt_ptrs, qb_ptrs, st_ptrs, sb_ptrs, x_ptrs, x_ok, k0, K, t, ROW_TILES, NUM_WARPS,
                            EVEN_K, USE_ASM, F16)
        pdl_launch_next(PDL)
        # acc[.., j]: row g + 8 (j // 2), token 2t + j % 2
        rows = row[:, :, None] + 8 * (j // 2)  # (L, R, 4)
        toks = pid_m * 8 + 2 * t[:, None, None] + j % 2  # (L, 1, 4)
        mask = (rows < N) & (toks < M)
        last = True
        if SPLIT_K > 1:
            # Split-K without a second launch: each program stores its fp32 partial and takes a ticket
            # for its output tile; the program that draws the last ticket sums the partials in split
            # order (deterministic), finishes the tile and resets the counter for the next call.
            part = part_ptr + (toks * N + rows).to(tl.int64)  # (L, R, 4): split s at part + s * M * N
            tl.store(part + pid_k * M * N, acc, mask=mask)
            tl.debug_barrier()  # every thread's partial is written before the ticket is taken
            out_tile = pid_m * tl.num_programs(0) + pid_n
            last = tl.atomic_add(lock_ptr + out_tile, 1, sem="acq_rel", scope="gpu") == SPLIT_K - 1
            if last:
                acc = tl.zeros((L, ROW_TILES, 4), tl.float32)
                for s in range(SPLIT_K):  # .cg: read L2, never a stale line of this SM's L1
                    acc += tl.load(part + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + out_tile, 0, sem="relaxed", scope="gpu")
        if last:
            acc = _scale_bias(acc, rows % N, gs_ptr, bias_ptr, GS_PER_ROW, HAS_BIAS)
            tl.store(y_ptr + toks.to(tl.int64) * stride_ym + rows, acc.to(y_ptr.dtype.element_ty), mask=mask)


# ---- the wgmma kernel (2 to 256 rows of x; Hopper; written in Gluon) ----
#
# The mma kernel above keeps x in each warp's registers, so from 16 rows of x on every warp re-reads all
# of it; the tiled kernel shares x through shared memory but Triton's tl.dot then makes the decoded
# weights take a round trip through shared memory too. Gluon (Triton's lower-level dialect, with the
# layouts written out) expresses what Marlin does on Hopper: x sits in shared memory once per program
# and is the right operand of the warpgroup MMA (wgmma, m64 x BT x k16, fp32 accumulation), while the
# decoded weights are its LEFT operand straight from registers. A warpgroup owns 64 weight rows; wgmma's
# register operand gives lane 4g + t of each warp, for each k16 chunk c, rows g and g + 8 of the warp's
# 16 at columns 16c + (2t, 2t+1, 2t+8, 2t+9). As in the mma kernel, which physical k a column stands for
# is ours to choose: lane t loads 16 contiguous bytes of its rows (the physical k (BK/4) t .. of the
# k-step), the mma kernel's PTX decodes each 32-bit word into the pairs (k3, k7), (k2, k6), (k1, k5),
# (k0, k4) (exact e2m1 * s * 2^-8), and those registers ARE the operand (Gluon checks that the layout
# conversion is free: assert_trivial). The right operand must follow the same order, so x is permuted
# along K once per call (k_ordered, a Triton kernel with wgmma_k_order's formula; one launch).
# Pipelining: x of the next k-step copies into a second shared buffer (cp.async) and the next step's
# codes and scales load into registers while this one decodes and multiplies. Within a k-step the
# decode and the MMAs overlap too: the step goes in slices of 64 k, and slice q's wgmma runs (async)
# while the lane decodes slice q + 1; only one slice's decoded registers wait for the tensor cores, not
# the whole step's (127 registers instead of 178 at 64 rows of x). Split-K as the mma kernel's: fp32
# partials and a ticket, the last program of a tile sums them in order.
# What it measured (H200, results/fp4_gemm_h200.md, sessions 9-10): gate/up at 16 / 64 rows of x 33 /
# 51 us against cuBLAS's 83 / 83; q/k/v and o (few output tiles) at 64 rows 14 and 12 us (cuBLAS: 13
# and 10.5); at 256 rows gate/up 149 us against cuBLAS's 100 and dequant + cuBLAS's 203 (the other
# layers: dequant + cuBLAS is as fast or faster). Two or four warpgroups a program sharing one x tile
# (half or a quarter of the x traffic) measured slower everywhere.
if HAS_GLUON:
    def _wgmma_word_asm(f16):
        """8 codes of a 32-bit word ($4; pack = 8 gives the asm 8 copies, $4-$11) → 4 registers $0-$3 of
        two values each, codes (3, 7), (2, 6), (1, 5), (0, 4) of the word, times the scale pair $12 (copies
        $12-$19): the mma kernel's word decode, so the pair holds s * 2^118 (bf16) or s * 2^6 (f16) and
        the result is exactly e2m1 * s * 2^-8."""
        return "{ .reg .b32 n, q8; " + _word_decode_ptx("$4", ["$0", "$1", "$2", "$3"], "$12", f16) + " }"

    _cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier  # (triton 3.8's name / 3.6's)
    _WGMMA_ASM: gl.constexpr = gl.constexpr((_wgmma_word_asm(False), _wgmma_word_asm(True)))
    _WGMMA_CONSTRAINTS: gl.constexpr = gl.constexpr("=r,=r,=r,=r," + ",".join(["r"] * 16))

    @gluon.constexpr_function
    def _lane_local(inner, elems):
        """(64 rows, 4, inner[, 8]) with lane 4g + t of warp w holding rows 16w + g and 16w + g + 8 at index t
        of axis 1, axis 2 (and the 8 elements of axis 3) in its registers: how each lane loads its own
        pieces. elems = 8 adds the last axis (one register per element: broadcasting a word to 8 values
        would otherwise keep it as one register, and the asm's 8 outputs would come out as one value)."""
        e = [[0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 4]] if elems == 8 else []
        pad = [0] if elems == 8 else []
        regs = e + [[0, 0, 1 << i] + pad for i in range(inner.bit_length() - 1)] + [[8, 0, 0] + pad]
        lanes = [[0, 1, 0] + pad, [0, 2, 0] + pad, [1, 0, 0] + pad, [2, 0, 0] + pad, [4, 0, 0] + pad]
        warps = [[16, 0, 0] + pad, [32, 0, 0] + pad]
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=warps, block_bases=[],
                                          shape=[64, 4, inner] + ([8] if elems == 8 else []))

    @gluon.jit
    def _wgmma_decode(words, sb, a_l: gl.constexpr, F16: gl.constexpr):
        """A 64-wide k slice of the weight tile in wgmma's register-operand layout (64, 64): words (64, 4, 2)
        of codes and sb (64, 4, 1) their E4M3 scale bytes, lane-local."""
        sf = sb.to(gl.float8e4nv, bitcast=True).to(gl.float32)
        if F16:
            sw = (sf * 64.0).to(gl.float16).to(gl.uint16, bitcast=True).to(gl.uint32)
        else:
            sw = (sf * 3.3230699894622794e+35).to(gl.bfloat16).to(gl.uint16, bitcast=True).to(gl.uint32)  # * 2^118
        sw = sw | (sw << 16)  # the pair (s, s), for both words
        sw = gl.convert_layout(sw.broadcast_to((64, 4, 2)), words.type.layout)
        l8: gl.constexpr = _lane_local(2, 8)
        w8 = gl.convert_layout(gl.reshape(words, (64, 4, 2, 1)).broadcast_to((64, 4, 2, 8)), l8)
        s8 = gl.convert_layout(gl.reshape(sw, (64, 4, 2, 1)).broadcast_to((64, 4, 2, 8)), l8)
        vals = gl.inline_asm_elementwise(_WGMMA_ASM[F16], _WGMMA_CONSTRAINTS, [w8, s8],
                                         dtype=gl.float16 if F16 else gl.bfloat16, is_pure=True, pack=8)
        # element e = 4 a + 2 b + h of word j → chunk c = 2 j + a, column 8 b + 2 t + h of the chunk
        vals = gl.permute(gl.reshape(vals, (64, 4, 2, 2, 2, 2)), (0, 2, 3, 4, 1, 5))  # (row, j, a, b, t, h)
        return gl.convert_layout(gl.reshape(vals, (64, 64)), a_l, assert_trivial=True)

    @gluon.jit
    def _slice_of(t, s: gl.constexpr, Q: gl.constexpr):
        """Slice s of Q (1, 2 or 4) along the last axis of a lane-local (64, 4, Q * E) tensor, as (64, 4, E):
        register moves only, as that axis is in each lane's registers."""
        E: gl.constexpr = t.shape[2] // Q
        out = t
        if Q == 2:
            lo, hi = gl.split(gl.permute(gl.reshape(t, (64, 4, 2, E)), (0, 1, 3, 2)))
            out = hi if s == 1 else lo
        elif Q == 4:  # s = 2 s1 + s0: split on s0, then on s1
            lo, hi = gl.split(gl.reshape(gl.permute(gl.reshape(t, (64, 4, 4, E)), (0, 1, 3, 2)), (64, 4, E, 2, 2)))
            lo, hi = gl.split(hi if s % 2 == 1 else lo)
            out = hi if s // 2 == 1 else lo
        return out

    @gluon.jit
    def _wgmma_step(acc, a, words, sb, x_step, a_l: gl.constexpr, BT: gl.constexpr, F16: gl.constexpr):
        """One k-step's MMAs: a = slice 0 already decoded from words / sb (lane-local codes and scales of
        the step), x_step its x in shared memory, (Q · BT, 64). Slice q's MMA runs (async) while slice
        q + 1 decodes; one MMA in flight at a time."""
        Q: gl.constexpr = sb.shape[2]
        for q in gl.static_range(Q):
            acc = warpgroup_mma(a, x_step.slice(q * BT, BT).permute((1, 0)), acc, is_async=True)
            if q + 1 < Q:
                a_next = _wgmma_decode(_slice_of(words, q + 1, Q), _slice_of(sb, q + 1, Q), a_l, F16)
                acc, a = warpgroup_mma_wait(0, deps=[acc, a])
                a = a_next
        acc, a = warpgroup_mma_wait(0, deps=[acc, a])
        return acc

    @gluon.jit
    def _wgmma_pdl_wait(PDL: gl.constexpr):
        """pdl_wait in Gluon (the same PTX instruction)."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def _wgmma_pdl_launch_next(PDL: gl.constexpr):
        """pdl_launch_next in Gluon."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _wgmma_finish(acc, rows, toks, mask, gs_ptr, bias_ptr, y_ptr, N, stride_ym, GS_PER_ROW: gl.constexpr,
                      HAS_BIAS: gl.constexpr):
        """acc (64 rows of W, BT tokens): times 256/g, plus the bias, stored to y (tokens x rows)."""
        if GS_PER_ROW:
            acc = acc * (256.0 / gl.load(gs_ptr + rows % N))[:, None]
        else:
            acc = acc * (256.0 / gl.load(gs_ptr))
        if HAS_BIAS:
            acc += gl.load(bias_ptr + rows % N).to(gl.float32)[:, None]
        gl.store(y_ptr + toks[None, :].to(gl.int64) * stride_ym + rows[:, None], acc.to(y_ptr.dtype.element_ty),
                 mask=mask)

    @gluon.jit
    def _wgmma_split_sum(acc, rows, toks, mask, tile, pid_k, row0, gs_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, M, N,
                         stride_ym, parts, GS_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr):
        """Split K's end: this split's (pid_k of `parts`) fp32 partial, then a ticket; the tile's last program
        sums the partials in order and stores y. The partials (parts, M, N - row0) hold the weight rows from
        row0 on."""
        n_part = N - row0
        part = part_ptr + toks[None, :].to(gl.int64) * n_part + (rows[:, None] - row0)  # split s at + s · M · n_part
        gl.store(part + pid_k * M * n_part, acc, mask=mask)
        _cta_barrier()  # every thread's partial is written before the ticket is taken
        if gl.atomic_add(lock_ptr + tile, 1, sem="acq_rel", scope="gpu") == parts - 1:
            acc = gl.zeros_like(acc)
            for s in range(parts):  # .cg: read L2, never a stale line of this SM's L1. (A loop: with
                # static_range the loads all issued at once and took up to 38 more registers.)
                acc += gl.load(part + s * M * n_part, mask=mask, other=0.0, cache_modifier=".cg")
            gl.atomic_xchg(lock_ptr + tile, 0, sem="relaxed", scope="gpu")
            _wgmma_finish(acc, rows, toks, mask, gs_ptr, bias_ptr, y_ptr, N, stride_ym, GS_PER_ROW, HAS_BIAS)

    @gluon.jit
    def _wgmma_epilogue(acc, tile_n, pid_m, pid_k, parts, tiles_n, whole, gs_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr,
                        M, N, stride_ym, BT: gl.constexpr, SPLIT_K: gl.constexpr, WHOLE: gl.constexpr,
                        STREAM: gl.constexpr, GS_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr):
        """A warpgroup's (64 weight rows of tile tile_n, BT tokens) result: straight to y, or with split K
        through _wgmma_split_sum; with WHOLE, only the tiles from `whole` on are split; with STREAM, a tile
        that `parts` programs share (a stream-K piece: pid_k is this program's place among them)."""
        # a layout with each thread on 4 consecutive rows (= contiguous outputs of a token)
        out_l: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[16, 2], warps_per_cta=[1, 4],
                                               order=[0, 1])
        acc = gl.convert_layout(acc, out_l)
        rows = tile_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, out_l))
        toks = pid_m * BT + gl.arange(0, BT, layout=gl.SliceLayout(0, out_l))
        mask = (rows[:, None] < N) & (toks[None, :] < M)
        tile = pid_m * tiles_n + tile_n
        if STREAM:
            if parts == 1:
                _wgmma_finish(acc, rows, toks, mask, gs_ptr, bias_ptr, y_ptr, N, stride_ym, GS_PER_ROW, HAS_BIAS)
            else:
                _wgmma_split_sum(acc, rows, toks, mask, tile, pid_k, 0, gs_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, M,
                                 N, stride_ym, parts, GS_PER_ROW, HAS_BIAS)
        elif SPLIT_K == 1:
            _wgmma_finish(acc, rows, toks, mask, gs_ptr, bias_ptr, y_ptr, N, stride_ym, GS_PER_ROW, HAS_BIAS)
        elif WHOLE:
            if tile_n < whole:
                _wgmma_finish(acc, rows, toks, mask, gs_ptr, bias_ptr, y_ptr, N, stride_ym, GS_PER_ROW, HAS_BIAS)
            else:
                _wgmma_split_sum(acc, rows, toks, mask, tile, pid_k, 64 * whole, gs_ptr, bias_ptr, y_ptr, part_ptr,
                                 lock_ptr, M, N, stride_ym, SPLIT_K, GS_PER_ROW, HAS_BIAS)
        else:
            _wgmma_split_sum(acc, rows, toks, mask, tile, pid_k, 0, gs_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, M, N,
                             stride_ym, SPLIT_K, GS_PER_ROW, HAS_BIAS)

    @gluon.jit
    def _wgmma_kernel(x_ptr, wp_ptr, ws_ptr, gs_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, M, N, n_steps, stride_xm,
                      stride_ym, stride_wn, stride_sn, split_steps, BT: gl.constexpr, BK: gl.constexpr,
                      SPLIT_K: gl.constexpr, GS_PER_ROW: gl.constexpr, HAS_BIAS: gl.constexpr, F16: gl.constexpr,
                      PDL: gl.constexpr):
        """Program (n, m, s): 64 weight rows (a warpgroup), BT rows of x (permuted along K by wgmma_k_order),
        k-steps s · split_steps .. of BK (n_steps in all). stride_wn is in 32-bit words, the others in
        elements. Offsets count whole k-steps, so that Triton sees the 16-byte alignment of every load."""
        _wgmma_pdl_wait(PDL)
        pid_n = gl.program_id(0)
        pid_m = gl.program_id(1)
        pid_k = gl.program_id(2)
        W: gl.constexpr = BK // 32  # 32-bit words of codes a lane loads per row and k-step
        Q: gl.constexpr = BK // 64  # scale bytes a lane loads per row and k-step = slices of 64 k
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        w_l: gl.constexpr = _lane_local(W, 1)
        s_l: gl.constexpr = _lane_local(Q, 1)
        # lane-local pointers at k-step 0: row r, lane t, word j / scale byte q
        rw = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, w_l)))
        tw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, w_l)))
        jw = gl.arange(0, W, layout=gl.SliceLayout(0, gl.SliceLayout(1, w_l)))
        w_ptrs = (wp_ptr.to(gl.pointer_type(gl.uint32)) + (rw % N)[:, None, None] * stride_wn + W * tw[None, :, None]
                  + jw[None, None, :])
        rs = pid_n * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, gl.SliceLayout(2, s_l)))
        ts = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, s_l)))
        qs = gl.arange(0, Q, layout=gl.SliceLayout(0, gl.SliceLayout(1, s_l)))
        s_ptrs = ws_ptr + (rs % N)[:, None, None] * stride_sn + Q * ts[None, :, None] + qs[None, None, :]
        # x: a k-step's (BT, BK) tile as Q tiles (BT, 64) stacked along rows in NVMMA-swizzled shared memory
        # (row q · BT + m holds x[m, 64 q ..]); wgmma reads slice q as (64, BT)
        x_bl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                              warps_per_cta=[4, 1], order=[1, 0])
        xr = gl.arange(0, Q * BT, layout=gl.SliceLayout(1, x_bl))
        xm = pid_m * BT + xr % BT
        xk = gl.arange(0, 64, layout=gl.SliceLayout(0, x_bl))
        x_ptrs = x_ptr + xm[:, None].to(gl.int64) * stride_xm + (64 * (xr // BT))[:, None] + xk[None, :]
        x_ok = xm[:, None] < M
        x_bufs = gl.allocate_shared_memory(gl.float16 if F16 else gl.bfloat16, [2, Q * BT, 64],
                                           gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2))
        s_lo = pid_k * split_steps
        n = gl.minimum(split_steps, n_steps - s_lo)  # (the host makes every split non-empty)
        async_copy.async_copy_global_to_shared(x_bufs.index(0), x_ptrs + s_lo * BK, mask=x_ok)
        async_copy.commit_group()
        words = gl.load(w_ptrs + s_lo * (BK // 8))
        sb = gl.load(s_ptrs + s_lo * (BK // 16))
        acc = gl.zeros((64, BT), gl.float32, layout=mma_l)
        for i in range(n):
            # the next step: x into the other buffer (an empty copy past the end keeps the wait count
            # uniform), codes and scales into registers (the last step reloads its own)
            nxt = s_lo + i + (i + 1 < n).to(gl.int32)
            async_copy.async_copy_global_to_shared(x_bufs.index((i + 1) % 2), x_ptrs + nxt * BK,
                                                   mask=x_ok & (i + 1 < n))
            async_copy.commit_group()
            words_next = gl.load(w_ptrs + nxt * (BK // 8))
            sb_next = gl.load(s_ptrs + nxt * (BK // 16))
            a = _wgmma_decode(_slice_of(words, 0, Q), _slice_of(sb, 0, Q), a_l, F16)
            async_copy.wait_group(1)  # this step's x has landed (the next one may still be in flight)
            _cta_barrier()
            fence_async_shared()
            acc = _wgmma_step(acc, a, words, sb, x_bufs.index(i % 2), a_l, BT, F16)
            _cta_barrier()  # every warp is done with this buffer before the next step refills it
            words = words_next
            sb = sb_next
        _wgmma_pdl_launch_next(PDL)
        _wgmma_epilogue(acc, pid_n, pid_m, pid_k, SPLIT_K, gl.num_programs(0), 0, gs_ptr, bias_ptr, y_ptr, part_ptr,
                        lock_ptr, M, N, stride_ym, BT, SPLIT_K, False, False, GS_PER_ROW, HAS_BIAS)


# The warp-specialized variant (plan key STAGES): the same decode and MMAs, fed by a producer warp.
# In the kernel above each lane loads its own codes one k-step ahead, and at 64 rows of x Nsight
# Compute finds it waiting on those loads (long scoreboard) and on the block-wide barriers around x's
# buffers; at 1-8 rows the mma kernel waits on memory for the same reason (few bytes in flight). Here
# one extra warp (the producer, 24 registers) issues TMA copies of each k-step's codes (64 rows x 128
# bytes as 32-bit words, 128-byte swizzle, so the lanes' 16-byte reads hit distinct banks), scales
# (64 x 16 bytes) and x (Q tiles of BT x 64) into a ring of STAGES buffers, and the consumer
# warpgroups wait only on the ring's barriers (mbarrier: "ready" flips when a stage's bytes have
# landed, "empty" when its NWG consumers are done with it). Consumers read codes and scales from shared
# memory into the same lane-local registers as above and run the same slices. NWG = 2 or 3 puts two or
# three consumer warpgroups (128 or 192 weight rows) on one x tile: x crosses from L2 half or a third as
# often, and more MMAs and decodes are in flight an SM (what the gain is: four, with a third of x's
# traffic again, are no faster; session 28). Each consumer
# stores its own result (_wgmma_epilogue). TMA needs k-steps of 256 (a row's scales: 16 bytes).
# Measured on the H200 (results/fp4_gemm_h200.md, session 12): faster from 33 rows of x on, with a ring
# of 2 stages, which plan_forward uses there; at 1-32 rows no faster than the plain kernel or mma.
# PERSIST: one program an SM walks many tiles (_ws_tile's order) with one ring, so that the loads of a
# tile's first k-steps overlap the consumers' stores of the tile before: gate/up at 1024 rows 435 ->
# 402 us (session 26), where a program's 14 k-steps are short next to its fill and its stores.
# STREAM (stream-K, with PERSIST): the last one or two waves of tiles are not dealt out whole, which
# leaves SMs idle when the tiles do not divide evenly among them (down's 56 tiles at 256 rows on 132
# SMs), but as k-steps: every program takes the same run of them, tile after tile (_stream_k), so
# a tile may be shared by a few programs, which sum their fp32 partials as split K does (the last to
# finish adds them up in order; no program waits on another). 14B down at 256 rows 97 -> 73 us, 7B
# gate/up at 1024 rows 0.79 -> 0.86x cuBLAS (session 27).
if HAS_GLUON:
    @gluon.constexpr_function
    def _lane_local_2d(inner):
        """_lane_local(inner, 1) flattened to (64, 4 · inner): what a (64, 4 · inner) tile in shared memory
        loads into, each lane taking the same pieces as it would from global memory."""
        regs = [[0, 1 << i] for i in range(inner.bit_length() - 1)] + [[8, 0]]
        lanes = [[0, inner], [0, 2 * inner], [1, 0], [2, 0], [4, 0]]
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=lanes, warp_bases=[[16, 0], [32, 0]],
                                          block_bases=[], shape=[64, 4 * inner])

    @gluon.jit
    def _ws_tile(t, pid_m, tile_n, m_tiles, tiles_n, group_m, PERSIST: gl.constexpr):
        """The tile of x and the weight tile of a program's t-th tile: (pid_m, tile_n) as given, or with
        PERSIST tile t in grouped order: tiles of x in groups of group_m, each group against every weight
        tile, the group's tiles of x side by side."""
        tm, tn = pid_m, tile_n
        if PERSIST:
            per_group = group_m * tiles_n
            first = (t // per_group) * group_m
            rows = gl.minimum(m_tiles - first, group_m)
            r = t % per_group
            tm, tn = first + r % rows, r // rows
        return tm, tn

    @gluon.jit
    def _ws_load(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, tok0, row0, k_lo, k_hi, i,
                 BT: gl.constexpr, STAGES: gl.constexpr, NWG: gl.constexpr):
        """The producer's work for one tile: k-steps k_lo .. k_hi - 1 of codes and scales (NWG tiles of 64
        weight rows from row0) and x (tokens from tok0) into the ring, stage i % STAGES on, each stage once
        its consumers have released it. Returns the k-steps loaded so far."""
        Q: gl.constexpr = 4  # 64-k slices of a k-step of 256
        nbytes: gl.constexpr = NWG * (w_desc.block_type.nbytes + s_desc.block_type.nbytes) + Q * x_desc.block_type.nbytes
        for k in range(k_lo, k_hi):
            st = i % STAGES
            mbarrier.wait(empty.index(st), ((i // STAGES) & 1) ^ 1)  # (passes at once on a fresh barrier)
            bar = ready.index(st)
            mbarrier.expect(bar, nbytes)
            for g in gl.static_range(NWG):
                tma.async_copy_global_to_shared(w_desc, [row0 + 64 * g, k * 32], bar, w_bufs.index(st * NWG + g))
                tma.async_copy_global_to_shared(s_desc, [row0 + 64 * g, k * 16], bar, s_bufs.index(st * NWG + g))
            for q in gl.static_range(Q):
                tma.async_copy_global_to_shared(x_desc, [tok0, k * 256 + 64 * q], bar,
                                                x_bufs.index(st).slice(q * BT, BT))
            i += 1
        return i

    @gluon.jit
    def _ws_producer(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, tile_n, pid_m, s_lo, n, t_lo, t_hi,
                     t_step, m_tiles, tiles_n, group_m, u_lo, u_hi, BT: gl.constexpr, STAGES: gl.constexpr,
                     NWG: gl.constexpr, PERSIST: gl.constexpr, STREAM: gl.constexpr):
        """One warp: for each of the program's tiles (one, or with PERSIST t_lo, t_lo + t_step, .. < t_hi),
        k-steps s_lo .. s_lo + n into the ring (_ws_load); then with STREAM its share of the tiles from t_hi
        on (k-steps u_lo .. u_hi - 1 of theirs, counted tile after tile). The ring runs on across tiles, so
        the next tile's first k-steps load while the consumers store the last one."""
        i = 0  # k-steps loaded so far
        for t in range(t_lo, t_hi, t_step):
            tm, tn = _ws_tile(t, pid_m, tile_n, m_tiles, tiles_n, group_m, PERSIST)
            i = _ws_load(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, tm * BT, tn * 64 * NWG, s_lo,
                         s_lo + n, i, BT, STAGES, NWG)
        if STREAM:
            for r in range(u_lo // n, (u_hi + n - 1) // n):
                tm, tn = _ws_tile(t_hi + r, pid_m, tile_n, m_tiles, tiles_n, group_m, PERSIST)
                i = _ws_load(w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, tm * BT, tn * 64 * NWG,
                             gl.maximum(u_lo - r * n, 0), gl.minimum(u_hi - r * n, n), i, BT, STAGES, NWG)

    @gluon.jit
    def _ws_mma(w_bufs, s_bufs, x_bufs, ready, empty, wg, n, i, BT: gl.constexpr, STAGES: gl.constexpr,
                NWG: gl.constexpr, F16: gl.constexpr):
        """A consumer's work for one tile: its 64 weight rows x BT tokens over the next n k-steps of the
        ring, from stage i % STAGES on, each stage released once read. Returns the sum and the k-steps
        consumed so far."""
        mma_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BT, 16])
        a_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_l, k_width=2)
        acc = gl.zeros((64, BT), gl.float32, layout=mma_l)
        for _ in range(n):
            st = i % STAGES
            mbarrier.wait(ready.index(st), (i // STAGES) & 1)
            words = w_bufs.index(st * NWG + wg).load(_lane_local_2d(8)).to(gl.uint32, bitcast=True)
            words = gl.convert_layout(gl.reshape(words, (64, 4, 8)), _lane_local(8, 1), assert_trivial=True)
            sb = s_bufs.index(st * NWG + wg).load(_lane_local_2d(4))
            sb = gl.convert_layout(gl.reshape(sb, (64, 4, 4)), _lane_local(4, 1), assert_trivial=True)
            a = _wgmma_decode(_slice_of(words, 0, 4), _slice_of(sb, 0, 4), a_l, F16)
            acc = _wgmma_step(acc, a, words, sb, x_bufs.index(st), a_l, BT, F16)
            fence_async_shared()  # this warpgroup's reads are ordered before the producer's next TMA writes
            mbarrier.arrive(empty.index(st), count=1)
            i += 1
        return acc, i

    @gluon.jit
    def _ws_consumer(w_bufs, s_bufs, x_bufs, ready, empty, n, wg, tile_n, pid_m, pid_k, tiles_n, whole, t_lo, t_hi,
                     t_step, m_tiles, group_m, u_lo, u_hi, sk_per, gs_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, M, N,
                     stride_ym, BT: gl.constexpr, STAGES: gl.constexpr, NWG: gl.constexpr, SPLIT_K: gl.constexpr,
                     WHOLE: gl.constexpr, PERSIST: gl.constexpr, STREAM: gl.constexpr, GS_PER_ROW: gl.constexpr,
                     HAS_BIAS: gl.constexpr, F16: gl.constexpr):
        """One warpgroup: weight rows of 64-row tile wg of the program's tile_n (NWG of them) x BT tokens
        over the n k-steps, for each of the program's tiles, then its stream-K pieces (as the producer's).
        A piece of tile r (from t_hi) belongs to the programs whose sk_per k-steps overlap r's: the first is
        r · n // sk_per, this one is u_lo // sk_per."""
        i = 0  # k-steps consumed so far
        for t in range(t_lo, t_hi, t_step):
            tm, tn = _ws_tile(t, pid_m, tile_n, m_tiles, tiles_n, group_m, PERSIST)
            acc, i = _ws_mma(w_bufs, s_bufs, x_bufs, ready, empty, wg, n, i, BT, STAGES, NWG, F16)
            _wgmma_epilogue(acc, tn * NWG + wg, tm, pid_k, SPLIT_K, tiles_n * NWG, whole * NWG, gs_ptr, bias_ptr, y_ptr,
                            part_ptr, lock_ptr, M, N, stride_ym, BT, SPLIT_K, WHOLE, False, GS_PER_ROW, HAS_BIAS)
        if STREAM:
            for r in range(u_lo // n, (u_hi + n - 1) // n):
                tm, tn = _ws_tile(t_hi + r, pid_m, tile_n, m_tiles, tiles_n, group_m, PERSIST)
                steps = gl.minimum(u_hi - r * n, n) - gl.maximum(u_lo - r * n, 0)
                acc, i = _ws_mma(w_bufs, s_bufs, x_bufs, ready, empty, wg, steps, i, BT, STAGES, NWG, F16)
                first = r * n // sk_per
                parts = ((r + 1) * n - 1) // sk_per - first + 1
                _wgmma_epilogue(acc, tn * NWG + wg, tm, u_lo // sk_per - first, parts, tiles_n * NWG, 0, gs_ptr,
                                bias_ptr, y_ptr, part_ptr, lock_ptr, M, N, stride_ym, BT, SPLIT_K, WHOLE, True,
                                GS_PER_ROW, HAS_BIAS)

    @gluon.jit
    def _wgmma_ws_kernel(x_desc, w_desc, s_desc, gs_ptr, bias_ptr, y_ptr, part_ptr, lock_ptr, M, N, n_steps,
                         stride_ym, split_steps, tiles_n, whole, m_tiles, group_m, stream_from, sk_per,
                         BT: gl.constexpr, STAGES: gl.constexpr, NWG: gl.constexpr, SPLIT_K: gl.constexpr,
                         WHOLE: gl.constexpr, PERSIST: gl.constexpr, STREAM: gl.constexpr, GS_PER_ROW: gl.constexpr,
                         HAS_BIAS: gl.constexpr, F16: gl.constexpr, PDL: gl.constexpr, CONSUMER_REGS: gl.constexpr):
        """Program (m, n, s): BT rows of x (tile m, in wgmma_k_order, through x_desc) against weight tile n
        of NWG · 64 rows, k-steps of 256 s · split_steps .. (n_steps in all). With WHOLE, program (m, j):
        tile j whole for j < whole, then one split of a later tile, splits after splits: j = whole +
        s · (tiles_n - whole) + (n - whole). With PERSIST (unsplit), program p of a 1-D grid: tiles p, p +
        grid, .. below stream_from of m_tiles x tiles_n, in _ws_tile's order; with STREAM too (stream-K)
        k-steps p · sk_per .. (p + 1) · sk_per - 1 of the tiles from stream_from on, counted tile after tile,
        so that every program gets the same work however few tiles there are. x_desc, w_desc, s_desc: TMA
        descriptors of x (BT, 64), the codes as 32-bit words (64, 32) and the scale bytes (64, 16)."""
        _wgmma_pdl_wait(PDL)
        t_lo, t_hi, t_step = 0, 1, 1  # one tile a program
        u_lo, u_hi = 0, 0  # stream-K k-steps
        if PERSIST:
            t_lo, t_hi, t_step = gl.program_id(0), stream_from, gl.num_programs(0)
            pid_m, tile_n, pid_k, s_lo, n = 0, 0, 0, 0, n_steps  # (the tile's own set in the loops)
            if STREAM:
                u_lo = gl.program_id(0) * sk_per
                u_hi = gl.minimum(u_lo + sk_per, (m_tiles * tiles_n - stream_from) * n_steps)
        elif WHOLE:
            pid_m = gl.program_id(0)
            j = gl.program_id(1)
            split = (j >= whole).to(gl.int32)
            js = (j - whole) * split  # (0 for a whole tile)
            tile_n = j * (1 - split) + (whole + js % (tiles_n - whole)) * split
            pid_k = js // (tiles_n - whole)
            s_lo = pid_k * split_steps
            n = gl.minimum(split_steps + n_steps * (1 - split), n_steps - s_lo)  # (every split non-empty)
        else:
            pid_m = gl.program_id(0)
            tile_n = gl.program_id(1)
            pid_k = gl.program_id(2)
            s_lo = pid_k * split_steps
            n = gl.minimum(split_steps, n_steps - s_lo)  # (the host makes every split non-empty)
        w_bufs = gl.allocate_shared_memory(gl.int32, [STAGES * NWG, 64, 32], w_desc.layout)
        s_bufs = gl.allocate_shared_memory(gl.uint8, [STAGES * NWG, 64, 16], s_desc.layout)
        x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES, 4 * BT, 64], x_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for b in gl.static_range(STAGES):
            mbarrier.init(ready.index(b), count=1)
            mbarrier.init(empty.index(b), count=NWG)
        # the partitions: consumer 0 in this program's 4 warps, the producer warp, [consumers 1 .. NWG - 1 in 4
        # more warps each]. Each list is spelled out whole: Gluon will not hold a (function, args) pair in a
        # variable ("cannot convert JITFunction to tensor", triton 3.6, session 14), nor the args alone (their
        # constexprs stop being constexpr, triton 3.8, session 28), so no list can reuse another's entries.
        if NWG == 1:
            gl.warp_specialize([
                (_ws_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, n, 0, tile_n, pid_m, pid_k, tiles_n, whole,
                                t_lo, t_hi, t_step, m_tiles, group_m, u_lo, u_hi, sk_per, gs_ptr, bias_ptr, y_ptr,
                                part_ptr, lock_ptr, M, N, stride_ym, BT, STAGES, NWG, SPLIT_K, WHOLE, PERSIST, STREAM,
                                GS_PER_ROW, HAS_BIAS, F16)),
                (_ws_producer, (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, tile_n, pid_m, s_lo, n,
                                t_lo, t_hi, t_step, m_tiles, tiles_n, group_m, u_lo, u_hi, BT, STAGES, NWG, PERSIST,
                                STREAM)),
            ], [1], [24])
        elif NWG == 2:
            gl.warp_specialize([
                (_ws_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, n, 0, tile_n, pid_m, pid_k, tiles_n, whole,
                                t_lo, t_hi, t_step, m_tiles, group_m, u_lo, u_hi, sk_per, gs_ptr, bias_ptr, y_ptr,
                                part_ptr, lock_ptr, M, N, stride_ym, BT, STAGES, NWG, SPLIT_K, WHOLE, PERSIST, STREAM,
                                GS_PER_ROW, HAS_BIAS, F16)),
                (_ws_producer, (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, tile_n, pid_m, s_lo, n,
                                t_lo, t_hi, t_step, m_tiles, tiles_n, group_m, u_lo, u_hi, BT, STAGES, NWG, PERSIST,
                                STREAM)),
                (_ws_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, n, 1, tile_n, pid_m, pid_k, tiles_n, whole,
                                t_lo, t_hi, t_step, m_tiles, group_m, u_lo, u_hi, sk_per, gs_ptr, bias_ptr, y_ptr,
                                part_ptr, lock_ptr, M, N, stride_ym, BT, STAGES, NWG, SPLIT_K, WHOLE, PERSIST, STREAM,
                                GS_PER_ROW, HAS_BIAS, F16)),
            ], [1, 4], [24, CONSUMER_REGS])
        else:
            gl.warp_specialize([
                (_ws_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, n, 0, tile_n, pid_m, pid_k, tiles_n, whole,
                                t_lo, t_hi, t_step, m_tiles, group_m, u_lo, u_hi, sk_per, gs_ptr, bias_ptr, y_ptr,
                                part_ptr, lock_ptr, M, N, stride_ym, BT, STAGES, NWG, SPLIT_K, WHOLE, PERSIST, STREAM,
                                GS_PER_ROW, HAS_BIAS, F16)),
                (_ws_producer, (w_desc, s_desc, x_desc, w_bufs, s_bufs, x_bufs, ready, empty, tile_n, pid_m, s_lo, n,
                                t_lo, t_hi, t_step, m_tiles, tiles_n, group_m, u_lo, u_hi, BT, STAGES, NWG, PERSIST,
                                STREAM)),
                (_ws_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, n, 1, tile_n, pid_m, pid_k, tiles_n, whole,
                                t_lo, t_hi, t_step, m_tiles, group_m, u_lo, u_hi, sk_per, gs_ptr, bias_ptr, y_ptr,
                                part_ptr, lock_ptr, M, N, stride_ym, BT, STAGES, NWG, SPLIT_K, WHOLE, PERSIST, STREAM,
                                GS_PER_ROW, HAS_BIAS, F16)),
                (_ws_consumer, (w_bufs, s_bufs, x_bufs, ready, empty, n, 2, tile_n, pid_m, pid_k, tiles_n, whole,
                                t_lo, t_hi, t_step, m_tiles, group_m, u_lo, u_hi, sk_per, gs_ptr, bias_ptr, y_ptr,
                                part_ptr, lock_ptr, M, N, stride_ym, BT, STAGES, NWG, SPLIT_K, WHOLE, PERSIST, STREAM,
                                GS_PER_ROW, HAS_BIAS, F16)),
            ], [1, 4, 4], [24, CONSUMER_REGS, CONSUMER_REGS])


def _kernels(device):
    """This module's kernels; on CPU tensors they must be the interpreter's (see the import above)."""
    this = sys.modules[__name__]
    if device.type == "cpu" and type(this._gemv_kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("fp4_gemm: Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton "
                           "is first imported")
    return this


# ---------------------------------------------------------------------------------------------
# Per-shape configs (measured on an H200 with --tune; see results/fp4_gemm_h200.md)
# ---------------------------------------------------------------------------------------------

def _tl_dtype(dtype):
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}[dtype]


def plan_forward(M, N, K, dtype, device, mma=True):
    """The kernel and its launch config for y (M, N) = x (M, K) @ W^T: a small table read off
    `python fp4_gemm.py --bench/--tune` on an H200 (Qwen2.5-7B shapes; results/fp4_gemm_h200.md). Fixed
    per shape, so nothing is tuned at run time (CUDA-graph and torch.compile safe). Returns a dict
    whose "kernel" is "mma", "gemv", "wgmma", "tiled" or "dequant". mma=False: a plan without the mma
    and wgmma kernels (for packed codes they cannot read as aligned words)."""
    kernel = _choice["kernel"]
    wgmma = mma and _wgmma_runs(K, dtype, device)
    mma = mma and dtype != torch.float32 and K % 64 == 0
    if (kernel == "mma" and not mma) or (kernel == "wgmma" and not wgmma):
        kernel = None
    if device.type == "cpu":  # the interpreter: few, large programs run fastest
        if kernel == "mma":
            return dict(kernel="mma", ROW_TILES=1, num_warps=2, SPLIT_K=2 if K >= 512 else 1)
        if kernel == "gemv":
            return dict(kernel="gemv", BLOCK_N=16, BLOCK_K=64, SPLIT_K=2 if K >= 128 else 1)
        if kernel == "dequant":
            return dict(kernel="dequant")
        return dict(kernel="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, SPLIT_K=1, num_warps=4,
                    num_stages=2)
    if kernel is None:
        if mma and (M == 1 or (M <= 8 and not wgmma)):
            kernel = "mma"  # 1.7-2.5x cuBLAS at M = 1, 1.4-2.0x at M = 8; on Hopper wgmma is faster from 2 rows
        elif M == 1:
            kernel = "gemv"  # 1.2-1.8x
        elif wgmma and (M <= 256 or (K % 256 == 0 and ((M <= 2048 and N >= 16384) or (M <= 512 and K >= 8192)))):
            kernel = "wgmma"  # 1.3-2.5x cuBLAS at 16 rows, 0.9-1.7x at 64, 0.7-1.0x at 256 (dequant 0.5-0.8x);
            # gate/up-like (wide) layers up to 2048 rows and down-like (long-K) ones up to 512, stream-K (below)
        elif M > 128 or dtype == torch.float32:
            kernel = "dequant"  # compute dominates: this layer's bf16 weight + cuBLAS (fp32: exact fp32 GEMM)
        else:
            kernel = "tiled"
    if kernel == "dequant":
        return dict(kernel="dequant", DQ=(16, 256, 4))
    if kernel == "mma":  # 64 weight rows a program, 128 (two row tiles a warp, sharing each lane's x) for
        # gate/up from 2 rows of x and for q/k/v and down from 5; split K (up to 8 ways, 16 for down's long
        # K) until there are ~2000 programs at M = 1, ~500 a row tile above (measured best on the Qwen2.5-7B
        # shapes: `--tune`, results/fp4_gemm_h200.md)
        rt = 2 if (M > 1 and N >= 16384) or (M > 4 and (N > 4096 or K >= 8192)) else 1
        cap = 16 if K >= 8192 else 8
        split = 1
        while split < cap and triton.cdiv(N, 64 * rt) * split < (2000 if M == 1 else 500 * rt):
            split *= 2
        return dict(kernel="mma", ROW_TILES=rt, num_warps=4, SPLIT_K=split)
    if kernel == "wgmma":  # 64 weight rows x 16, 32, 64 or 128 rows of x a program (128 for the wide or
        # long layers above 64 rows), k-steps of 256 or 128; K split to give the narrow layers more programs:
        # 8 ways below 64 rows of x, 4 at 64 rows, 2 above; gate/up has programs enough unsplit (the best
        # found on the Qwen2.5-7B shapes, results/fp4_gemm_h200.md, sessions 9 and 12)
        bt = _wgmma_rows_of_x(M, N, K)
        # persistent programs (one an SM) over tiles of 128 rows of x in groups of 16, so that the ring loads
        # the next tile while the consumers store the last, with the last one or two waves' k-steps shared out
        # evenly (stream-K): gate/up-like layers at 129-2048 rows, down-like ones at 257-512, both with three
        # consumer warpgroups (192 weight rows: more decodes and MMAs in flight an SM than two). On the 7B,
        # 14B and 32B shapes: gate/up at 256-2048 rows 0.85-1.00x cuBLAS, where two warpgroups took
        # 0.79-0.88x and dequant + cuBLAS 0.48-0.88x; down at 384-512 0.76-0.81x, against 0.71-0.78x with two
        # and dequant's 0.62-0.67x; down at 256 and 768 gained nothing (H200, results/fp4_gemm_h200.md,
        # sessions 27-28)
        stream = dict(kernel="wgmma", BT=128, BLOCK_K=256, SPLIT_K=1, STAGES=2, NWG=3, PERSIST=True, STREAM=True,
                      GROUP_M=16)
        if K % 256 == 0 and (M > 256 or (M > 128 and N >= 16384)):
            return stream
        if K % 256 == 0 and (M > 32 or (M > 16 and N >= 16384)):  # warp-specialized, a 2-deep ring: down 13%
            # faster at 64 rows, every layer 2-15% faster at 128-256 (at 256, q/k/v, o and down ran dequant +
            # cuBLAS before: down 37% faster); no gain at 32 rows or fewer, where the plain kernel's own prefetch
            # keeps up, but for gate/up-like layers on three warpgroups (below)
            split = 1 if N >= 16384 else (4 if M <= 128 else 2) if K >= 8192 else 2 if M <= 64 else 1
            # gate/up-like layers: three consumer warpgroups (192 weight rows a program), unsplit but for the
            # last wave; at 32 / 33 / 64 / 128 rows of x 41.1 -> 39.4, 47.0 -> 44.3, 47.8 -> 45.7 and 67.4 -> 64.3
            # us on the 7B shape (32B at 64: 87.9 -> 85.5; 14B ties) against one or two (H200,
            # results/fp4_gemm_h200.md, session 28). The others: two (128 weight rows) under 128-row tiles of x,
            # except for o_proj's 3584 x 3584 at 256 rows (one: 18.8 us, two: 19.9 or more)
            nwg = 3 if N >= 16384 else 2 if bt == 128 and (N > 4096 or K >= 8192) else 1
            plan = dict(kernel="wgmma", BT=bt, BLOCK_K=256, SPLIT_K=split, STAGES=2, NWG=nwg)
            tiles, places = triton.cdiv(N, 64 * nwg) * triton.cdiv(M, bt), _ws_places(plan, device)
            if split > 1 and K >= 8192 and tiles * split > places:  # down-like layers whose
                # splits would spill past one wave: as many splits as fit in it, or stream-K where that is one.
                # 14B and 32B down (80 or 40 tiles, 7B's 56 or 28 fit): at 33-64 rows 3 splits, 1.29-1.33x ->
                # 1.72-1.86x cuBLAS; at 128 3, 0.87-0.94x -> 1.29-1.32x; at 256 stream-K, 0.64-0.65x ->
                # 0.82-0.91x (H200, results/fp4_gemm_h200.md, session 27)
                split = places // tiles
                if split < 2:  # (two consumer warpgroups here: three measured 0-3% slower, session 28)
                    return dict(stream, NWG=2)
                plan["SPLIT_K"] = split
            if split == 2 and N > K and 3 * tiles <= places:  # q/k/v when 3 splits of its
                # tiles fill at most one wave: 7B at 33-64 rows 13.4-14.0 -> 11.9-12.6 us; o (N = K) lost with 3
                # or 4 (results/fp4_gemm_h200.md, session 22)
                plan["SPLIT_K"] = 3
            return dict(plan, **_last_wave_split(plan, M, N, K, device)) if split == 1 else plan
        if N >= 16384:
            bk, split = 256 if M <= 32 else 128, 1
        elif bt == 128:
            bk, split = 128, 4 if M <= 128 else 2
        else:
            bk, split = 256, 8 if bt < 64 else 4 if M <= 64 else 2
        return dict(kernel="wgmma", BT=bt, BLOCK_K=bk if K % bk == 0 else 128, SPLIT_K=split)
    if kernel == "gemv":  # 8 rows a program; split K in two when that still leaves few programs
        return dict(kernel="gemv", BLOCK_N=8, BLOCK_K=512, SPLIT_K=2 if triton.cdiv(N, 8) < 500 else 1,
                    num_warps=4, num_stages=1)
    if M <= 16:
        if K >= 8192:  # down_proj: few output tiles, long K
            cfg = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, SPLIT_K=4, num_warps=4, num_stages=4)
        elif N >= 16384:  # gate/up: enough tiles already
            cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, SPLIT_K=2, num_warps=4, num_stages=3)
        else:  # q/k/v, o
            cfg = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, SPLIT_K=4, num_warps=4, num_stages=4)
    elif M <= 64:  # 32 or 64 rows a tile; few output tiles, so split K deeply (session 3's sweep)
        bm = 32 if M <= 32 else 64
        if N >= 16384:  # gate/up
            cfg = dict(BLOCK_N=128, SPLIT_K=4) if bm == 32 else dict(BLOCK_N=64, SPLIT_K=2)
        else:  # q/k/v and down: wide tiles; o: narrow
            cfg = dict(BLOCK_N=128 if N > 4096 or K >= 8192 else 64, SPLIT_K=8)
        cfg.update(BLOCK_M=bm, BLOCK_K=128, num_warps=4, num_stages=3)
    elif N >= 16384:
        cfg = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, SPLIT_K=1, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, SPLIT_K=2, num_warps=4, num_stages=4)
    return dict(kernel="tiled", GROUP_M=8, **cfg)


def _last_wave_split(plan, M, N, K, device):
    """For an unsplit warp-specialized plan whose tiles fill the GPU more than once but not a whole number
    of times: WHOLE (tiles taken whole, by the full waves) and SPLIT_K for the rest, whose k-steps are
    shared out over about one wave of programs. Else nothing. Gate/up at 64 rows of x on one consumer
    warpgroup has 592 tiles, two programs an SM: 528 whole in two waves, then 64 split four ways, where the
    last wave had 64 programs for 264 places (H200, results/fp4_gemm_h200.md, session 22); on three (as
    plan_forward now runs it), 198 tiles: 132 whole, then 66 split two ways."""
    m_tiles, tiles_n = triton.cdiv(M, plan["BT"]), triton.cdiv(N, 64 * plan["NWG"])
    places = _ws_places(plan, device)
    whole = tiles_n * m_tiles // places * places // m_tiles  # weight tiles of the full waves
    left = (tiles_n - whole) * m_tiles
    split = min(K // 256, places // left) if left else 1
    return dict(WHOLE=whole, SPLIT_K=split) if whole and split > 1 else {}


def _stream_k(tiles, steps, places):
    """How a persistent plan with STREAM shares `tiles` tiles of `steps` k-steps among `places` programs:
    whole tiles in turn for all full waves but the last (none below two waves), then the rest (one to two
    waves' worth) as stream-K: each program the same run of k-steps, counted tile after tile. Returns the
    first stream-K tile, the k-steps a program, and how many programs a tile can be shared by at most
    (the fp32 partials to hold)."""
    rest = tiles if tiles < 2 * places else tiles % places + places
    per = triton.cdiv(rest * steps, places)
    return tiles - rest, per, min(places, (steps - 2 + per) // per + 1)


def _ws_places(plan, device):
    """How many programs of a warp-specialized plan the GPU runs at once (one wave)."""
    return _ws_programs_per_sm(plan) * _sm_count(device)


def _ws_ring_bytes(plan):
    """Shared memory of a warp-specialized plan's ring: codes (64 x 32 words) and scales (64 x 16 bytes) of
    each warpgroup's weight rows, and x (4 · BT x 64 bf16), for every stage."""
    return plan["STAGES"] * (plan["NWG"] * (64 * 32 * 4 + 64 * 16) + 4 * plan["BT"] * 64 * 2)


def _ws_programs_per_sm(plan):
    """How many programs of a warp-specialized plan an H100 / H200 SM holds: 227 KB of shared memory a
    program at most (228 an SM, 1 reserved a program) for the ring (_ws_ring_bytes), and 64K registers
    (the launch's maxnreg, _ws_maxnreg, for each of 4 · NWG + 1 warps)."""
    nwg = plan["NWG"]
    regs = _ws_maxnreg(nwg) * 32 * (4 * nwg + 1)
    return max(1, min((228 << 10) // (_ws_ring_bytes(plan) + (1 << 10)), 65536 // regs))


def _ws_maxnreg(nwg):
    """The launch's registers a thread of a warp-specialized plan with nwg consumer warpgroups (1, 2 or 3):
    what (nwg + 1) warpgroups may hold on one SM (the producer warp is padded to a warpgroup)."""
    return {1: 128, 2: 168, 3: 128}[nwg]


@functools.lru_cache(maxsize=None)
def _sm_count(device):  # (asked by plan_forward on every call of a layer: cached)
    return torch.cuda.get_device_properties(device).multi_processor_count


def _wgmma_rows_of_x(M, N, K):
    """Rows of x a wgmma program takes (the MMA's N): 16, 32 or 64, the smallest that holds M, at most 64;
    128 above 128 rows, and above 64 rows for gate/up-like (wide) and down-like (long-K) layers, whose
    decode then repeats half as often."""
    if M > 128 or (M > 64 and (N >= 16384 or K >= 8192)):
        return 128
    return 16 if M <= 16 else 32 if M <= 32 else 64


def _wgmma_runs(K, dtype, device):
    """The wgmma kernel needs Gluon, a Hopper GPU (sm_90), 16-bit x and K in whole k-steps of 128."""
    return (HAS_GLUON and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and K % 128 == 0
            and _is_hopper(device))


@functools.lru_cache(maxsize=None)
def _capability(device):  # (asked on every call of a layer: cached)
    cuda = device.type == "cuda" and torch.cuda.is_available()
    return torch.cuda.get_device_capability(device) if cuda else (0, 0)


def _is_hopper(device):
    return _capability(device) == (9, 0)


def plan_dx(M, N, K, dtype, device):
    """Kernel and config for dX (M, K) = dY (M, N) @ W. The training pass has M in the thousands, where
    dequant + cuBLAS measured best (0.8-0.9x cuBLAS on bf16 weights); the tiled kernel serves small M."""
    kernel = _choice["kernel"]
    if device.type == "cpu":
        if kernel == "dequant":
            return dict(kernel="dequant")
        return dict(kernel="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=2)
    if kernel == "dequant" or (kernel is None and (M > 128 or dtype == torch.float32)):
        return dict(kernel="dequant", DQ=(16, 256, 4))
    bm = 16 if M <= 16 else 64
    return dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)


# ---------------------------------------------------------------------------------------------
# Launchers (2-D x; uint8 views of the packed codes and the E4M3 scales)
# ---------------------------------------------------------------------------------------------

def _launch_opts(plan):
    return {k: plan[k] for k in ("num_warps", "num_stages") if k in plan}


def pdl_opts(device):
    """Launch options for a kernel that calls pdl_wait: programmatic dependent launch on a Hopper or newer
    GPU, unless QERL_PDL=0; elsewhere (older GPUs, the interpreter) a plain launch, and pdl_wait does
    nothing. Inside the decode step's CUDA graph this hides most of the gap between kernels: the batch-1
    to 64 steps of a 7B model took 5-7% less time (results/rollout_h200.md, session 8)."""
    if _choice["pdl"] and HAS_PDL and _capability(device) >= (9, 0):
        return dict(PDL=True, launch_pdl=True)
    return dict(PDL=False)


def dequantize_triton(packed, scale_u8, gs, dtype, cfg=None):
    """One weight, (N, K) in `dtype`, bit-identical to dequantize(); what the dequant path multiplies."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty(n, k, dtype=dtype, device=packed.device)
    bn, bk, warps = cfg or ((16, 256, 4) if packed.is_cuda else (32, 64, 4))
    _kernels(packed.device)._dequant_kernel[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        packed, scale_u8, gs, out, n, k, BLOCK_N=bn, BLOCK_K=bk, GS_PER_ROW=gs.numel() > 1, num_warps=warps)
    return out


_LOCKS = 1 << 16
_lock_buffers = {}


def _locks(device, tiles=0):
    """Split-K tickets for the mma and wgmma kernels and small_linear: one int32 counter per output
    tile (`tiles` of them needed), zero between calls (the last program of a tile resets it). Allocated
    once per device, so CUDA graphs can keep its address. Kernels on two streams at once would share the
    counters: run these kernels on one stream."""
    if tiles > _LOCKS:
        raise ValueError(f"fp4_linear: {tiles} output tiles exceed the split-K counters ({_LOCKS})")
    if device not in _lock_buffers:
        _lock_buffers[device] = torch.zeros(_LOCKS, dtype=torch.int32, device=device)
    return _lock_buffers[device]


def _pairs_aligned(x2):
    """16-bit x can be read as 32-bit pairs (x[2j], x[2j+1]): 4-byte aligned rows."""
    return x2.dtype in (torch.bfloat16, torch.float16) and x2.data_ptr() % 4 == 0 and x2.stride(0) % 2 == 0


def _words_aligned(packed):
    """The packed codes can be read as 32-bit words (8 codes each)."""
    return packed.data_ptr() % 4 == 0 and packed.stride(0) % 4 == 0


def _tma_fits(packed, scale_u8):
    """The warp-specialized wgmma kernel's TMA copies need 16-byte aligned rows of codes and scales and
    k-steps of 256 (a row's 16 scale bytes)."""
    return (packed.data_ptr() % 16 == 0 and packed.stride(0) % 16 == 0 and packed.shape[1] % 128 == 0
            and scale_u8.data_ptr() % 16 == 0 and scale_u8.stride(0) % 16 == 0)


def _mma_fits(x2, packed):
    """The mma kernel reads x as 32-bit pairs and the codes as 32-bit words (16-byte vectors when Triton
    sees 16-byte alignment), a lane's 64 k at a time."""
    return _pairs_aligned(x2) and x2.shape[1] % 64 == 0 and _words_aligned(packed)


def _tile_opts(x, plan):
    """The tiled kernels' dot dtype and decode. The interpreter (triton 3.8) multiplies bf16 dot operands
    as raw bits, so on CPU the tiles are dotted in fp32: the same exact products, accumulated in fp32 as
    the tensor cores do; it also runs the plain Triton decode instead of the PTX."""
    tdt = _tl_dtype(x.dtype) if x.is_cuda else tl.float32
    return dict(DTYPE=tdt, PRECISION="ieee" if tdt == tl.float32 else "tf32",
                USE_ASM=plan.get("asm", True) and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16))


def _chunk(K, parts, bk):
    """The width of each of `parts` K ranges, rounded up to whole blocks of bk (so the last ranges may
    be short, or empty)."""
    return triton.cdiv(triton.cdiv(K, parts), bk) * bk


def _small_split(K, bk=256):
    """K chunks for small_linear: whole blocks of bk, at most 32 chunks (tens of programs share A)."""
    k_split = _chunk(K, min(32, triton.cdiv(K, bk)), bk)
    return triton.cdiv(K, k_split), k_split


def _side_outputs(x2, SR, split):
    """x2 @ side^T's output (M, SR) in x2's dtype and its fp32 split-K partials (split, M, SR), the output
    itself when K is not split."""
    out = torch.empty(x2.shape[0], SR, dtype=x2.dtype, device=x2.device)
    return out, torch.empty(split, x2.shape[0], SR, dtype=torch.float32, device=x2.device) if split > 1 else out


def small_linear(x2, A, bk=256):
    """x2 (M, K) @ A^T (SR, K) for a few rows (decode: M <= 64) and a small dense A (a LoRA A)
    in one launch: K split in whole blocks of bk (at most 32 chunks, so tens of programs share A's bytes),
    the last program of a tile sums the fp32 partials in order (deterministic). cuBLAS takes two
    launches here (a split-K GEMM and a reduce). x2 and A share a dtype, as does the result."""
    x2, A = x2.contiguous(), A.contiguous()
    M, K = x2.shape
    SR = A.shape[0]
    split, k_split = _small_split(K, bk)
    out, part = _side_outputs(x2, SR, split)
    grid = (triton.cdiv(SR, 16), split, triton.cdiv(M, 16))
    _kernels(x2.device)._small_kernel[grid](x2, A, out, part, _locks(x2.device, grid[0] * grid[2]), M, K, SR,
                                            x2.stride(0), k_split, SPLIT=split, SPLIT_PAD=triton.next_power_of_2(split),
                                            BK=bk, F32=x2.dtype == torch.float32 or not x2.is_cuda, num_warps=4,
                                            **pdl_opts(x2.device))
    return out


def side_linear(x2, side):
    """x2 @ side^T on the Triton path with no weight to ride along with: small_linear up to 64 rows (32
    for a K of 8192 or more), cuBLAS above. On the H200 at rank 32 (a LoRA A), small_linear took 4.0-5.9
    µs up to 64 rows at K = 3584, where cuBLAS took 6.1-6.9 µs in two launches (a split-K GEMM and a
    reduce); at K = 18944 they tie at 32 rows and cuBLAS wins at 64 (7.0 against 8.3 µs)."""
    M, K = x2.shape
    return small_linear(x2, side) if M <= (32 if K >= 8192 else 64) else torch.nn.functional.linear(x2, side)


def wgmma_k_order(K, bk, device):
    """The wgmma kernel's K order: x_perm[:, i] = x[:, order[i]]. In each k-step of bk, MMA column 16 c +
    8 b + 2 t + h (chunk c = 2 j + a, lane t) holds element e = 4 a + 2 b + h of the lane's decoded word
    j, which is code 3 - (2 a + b) + 4 h of the word (the decode emits codes (3, 7), (2, 6), (1, 5), (0,
    4)): physical k (bk/4) t + 8 j + that. The reference that the tests hold k_ordered to (the kernel
    computes the same formula per column, with no index tensor)."""
    col = torch.arange(bk, device=device)
    c, b, t, h = col // 16, (col // 8) % 2, (col // 2) % 4, col % 2
    phys = (bk // 4) * t + 8 * (c // 2) + 3 - (2 * (c % 2) + b) + 4 * h
    return (torch.arange(0, K, bk, device=device)[:, None] + phys[None, :]).reshape(-1)


def k_ordered(x2, bk, out=None):
    """x2 (M, K) permuted along K into the wgmma kernel's order (x2[:, wgmma_k_order(K, bk)]) in one
    Triton launch: 1.6-5.0 µs up to 64 rows on the H200, where torch's index_select, a general gather,
    took 4.5-5.5. out: a contiguous (>= M, K) buffer for it (rows past M left as they are)."""
    M, K = x2.shape
    out = torch.empty(M, K, dtype=x2.dtype, device=x2.device) if out is None else out
    if M:
        block = 1024
        _kernels(x2.device)._k_order_kernel[(triton.cdiv(K, block) * M,)](
            x2, out, M, K, *x2.stride(), BK=bk, BLOCK=block, num_warps=4, **pdl_opts(x2.device))
    return out


def _x_rows(M, plan):
    """Rows of x a wgmma plan's programs read: M rounded up to whole tiles of BT. The rows past M are never
    stored (the plain kernel masks them, the warp-specialized variant's TMA copies read whole tiles: where
    a tile crossed the end of x, its zero-filled copy took gate/up at 33 rows from 49 to 72 us, H200,
    session 20)."""
    return triton.cdiv(M, plan["BT"]) * plan["BT"]


def _wgmma_linear(x2, packed, scale_u8, gs, bias, plan, x_k_ordered=False):
    """The wgmma kernel's launch: x permuted along K (k_ordered) into a buffer of _x_rows, then one launch
    that also sums its split-K partials. A plan with STAGES runs the warp-specialized variant (TMA
    descriptors of x, codes and scales; with WHOLE, only the weight tiles from WHOLE on split K; with
    PERSIST, one program a place walking the tiles in groups of GROUP_M tiles of x; with STREAM too, the
    last one or two waves' k-steps shared out evenly, _stream_k).
    x_k_ordered: x2 is in that order already, the first M rows of a buffer of _x_rows where its storage
    holds them (else the TMA copies zero-fill past M)."""
    M, K = x2.shape
    N = packed.shape[0]
    bt, bk, ws = plan["BT"], plan["BLOCK_K"], "STAGES" in plan
    rows = _x_rows(M, plan)
    if not x_k_ordered:
        xp = k_ordered(x2, bk, out=torch.empty(rows, K, dtype=x2.dtype, device=x2.device))
    elif (x2.storage_offset() + rows * K) * x2.element_size() <= x2.untyped_storage().nbytes():
        xp = x2.as_strided((rows, K), (K, 1))
    else:
        xp = x2
    steps = K // bk
    split_steps = triton.cdiv(steps, plan["SPLIT_K"])
    split = triton.cdiv(steps, split_steps)  # (every split non-empty)
    # tiles of 64 · NWG weight rows: with WHOLE (warp-specialized plans), the first ones unsplit, the rest split
    nwg = plan.get("NWG", 1)
    tiles_n, m_tiles = triton.cdiv(N, 64 * nwg), triton.cdiv(M, bt)
    whole = min(plan.get("WHOLE", 0), tiles_n) if ws else 0
    split, whole = (1, 0) if whole == tiles_n else (split, whole)
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    part = torch.empty(split, M, N - 64 * nwg * whole, dtype=torch.float32, device=x2.device) if split > 1 else y
    flags = dict(SPLIT_K=split, GS_PER_ROW=gs.numel() > 1, HAS_BIAS=bias is not None, F16=x2.dtype == torch.float16,
                 num_warps=4, **pdl_opts(x2.device))
    bias = bias if bias is not None else gs
    if not ws:
        grid = (triton.cdiv(N, 64), m_tiles, split)
        _wgmma_kernel[grid](xp, packed, scale_u8, gs, bias, y, part, _locks(x2.device, grid[0] * grid[1]), M, N, steps,
                            xp.stride(0), y.stride(0), packed.stride(0) // 4, scale_u8.stride(0), split_steps, BT=bt,
                            BK=bk, **flags)
        return y
    # the tiles of x side by side (the grid's first axis): each weight tile is read from memory once, by
    # programs that run together
    some_whole = whole > 0 and split > 1
    persist = plan.get("PERSIST", False) and split == 1
    stream_from, sk_per = m_tiles * tiles_n, 1  # (no stream-K tiles)
    if persist:  # one program a place, each taking tiles in grouped order
        places = _ws_places(plan, x2.device)
        grid = (min(m_tiles * tiles_n, places),)
        if plan.get("STREAM", False):
            grid = (places,)
            stream_from, sk_per, slots = _stream_k(m_tiles * tiles_n, steps, places)
            part = torch.empty(slots, M, N, dtype=torch.float32, device=x2.device) if slots > 1 else y
    elif some_whole:
        grid = (m_tiles, whole + (tiles_n - whole) * split)
    else:
        grid = (m_tiles, tiles_n, split)
    swizzled = lambda bits: gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    x_desc = TensorDescriptor.from_tensor(xp, [bt, 64], swizzled(16))
    w_desc = TensorDescriptor.from_tensor(packed.view(torch.int32), [64, 32], swizzled(32))
    s_desc = TensorDescriptor.from_tensor(scale_u8, [64, 16], gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                                                   element_bitwidth=8, rank=2))
    # Registers: `regs` a thread for every warpgroup of the program (the producer's counts as one); the
    # partitions then trade them (setmaxnreg): the producer keeps 24, the consumers share the rest evenly.
    regs = _ws_maxnreg(nwg)
    locks = _locks(x2.device, 0 if part is y else tiles_n * nwg * m_tiles)
    _wgmma_ws_kernel[grid](x_desc, w_desc, s_desc, gs, bias, y, part, locks, M, N, steps, y.stride(0), split_steps,
                           tiles_n, whole, m_tiles, plan.get("GROUP_M", m_tiles), stream_from, sk_per, BT=bt,
                           STAGES=plan["STAGES"], NWG=nwg, WHOLE=some_whole, PERSIST=persist,
                           STREAM=stream_from < m_tiles * tiles_n,
                           CONSUMER_REGS=((nwg + 1) * regs - 24) // nwg // 8 * 8, maxnreg=regs, **flags)
    return y


def _runnable_plan(x2, packed, scale_u8, plan=None):
    """The plan triton_linear runs for x2 @ W^T: `plan`, or plan_forward's, moved off what this memory
    cannot feed (the mma and wgmma kernels read aligned 32-bit words; the warp-specialized variant's
    TMA copies need 16-byte aligned rows, else the same tiles run without the producer warp)."""
    M, K = x2.shape
    N = packed.shape[0]
    plan = plan or plan_forward(M, N, K, x2.dtype, x2.device)
    if (plan["kernel"] == "mma" and not _mma_fits(x2, packed)) or (plan["kernel"] == "wgmma"
                                                                  and not _words_aligned(packed)):
        plan = plan_forward(M, N, K, x2.dtype, x2.device, mma=False)
    if "STAGES" in plan and plan["BLOCK_K"] != 256:
        raise ValueError(f"the warp-specialized wgmma kernel takes k-steps of 256, not {plan['BLOCK_K']}")
    if "STAGES" in plan and not _tma_fits(packed, scale_u8):
        plan = {k: v for k, v in plan.items() if k not in ("STAGES", "NWG", "WHOLE", "PERSIST", "GROUP_M", "STREAM")}
    return plan


def _side_rides(plan, M):
    """Whether a side product rides in this plan's launch: the mma kernel's side programs cover one row
    tile (up to 8 rows)."""
    return plan["kernel"] == "mma" and 0 < M <= 8


def triton_linear(x2, packed, scale_u8, gs, bias, plan=None, side=None, constant_weight=False,
                  x_k_ordered=False):
    """y (M, N) = x2 (M, K) @ W^T (+ bias) on the Triton path; `plan` overrides plan_forward.
    side: an optional small (SR, K) matrix in x2's dtype (rollout's LoRA A's); then returns (y, x2 @
    side^T): with the mma kernel (M <= 8) both from one launch; else side_linear's.
    constant_weight: the caller vouches that the kernel just before in the stream does not write the
    weight, so that the mma kernel may load its first codes before its launch wait (see pdl_wait).
    x_k_ordered: x2 is stored in the warp-specialized wgmma kernel's K order (see x_k_order), which the
    plan must then run."""
    M, K = x2.shape
    N = packed.shape[0]
    plan = _runnable_plan(x2, packed, scale_u8, plan)
    if x_k_ordered and not (_k_step_of(plan) and x2.is_contiguous() and x2.data_ptr() % 16 == 0 and side is None):
        raise ValueError(f"fp4_linear: x in K order needs the warp-specialized wgmma kernel's plan and a contiguous, "
                         f"16-byte aligned x, not {plan} for x {tuple(x2.shape)}")
    if side is not None and not _side_rides(plan, M):
        y = triton_linear(x2, packed, scale_u8, gs, bias, plan, constant_weight=constant_weight)
        return y, side_linear(x2, side)
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if M == 0:
        return y
    if plan["kernel"] == "dequant":
        w = dequantize_triton(packed, scale_u8, gs, x2.dtype, plan.get("DQ"))  # (N, K): this layer only, freed on return
        return torch.nn.functional.linear(x2, w, bias.to(x2.dtype) if bias is not None else None)
    if plan["kernel"] == "wgmma":
        return _wgmma_linear(x2, packed, scale_u8, gs, bias, plan, x_k_ordered)
    ker = _kernels(x2.device)
    split = plan.get("SPLIT_K", 1)
    bk = plan.get("BLOCK_K", 256)  # the mma kernel's k-step is 256
    k_split = _chunk(K, split, bk)
    split = triton.cdiv(K, k_split)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x2.device) if split > 1 else y
    bias_arg = bias if bias is not None else gs
    flags = dict(SPLIT_K=split, GS_PER_ROW=gs.numel() > 1, HAS_BIAS=bias is not None)
    if plan["kernel"] == "mma":
        nw, rt = plan["num_warps"], plan["ROW_TILES"]
        n_w = triton.cdiv(N, 16 * nw * rt)
        grid = [n_w, triton.cdiv(M, 8), split]
        # The side product's programs follow the weight's along axis 0: its K chunks (as small_linear's,
        # rounded up to a multiple of the weight's split) spread over `cols` columns a tile x the split axis.
        sa, sout, spart, sr, sk, cols, sside = gs, gs, gs, 0, 0, 0, 1
        if side is not None:
            sr, cols = side.shape[0], triton.cdiv(_small_split(K)[0], split)
            sside = cols * split
            sk = _chunk(K, sside, 256)
            sa, (sout, spart) = side.contiguous(), _side_outputs(x2, sr, sside)
            grid[0] += triton.cdiv(sr, 16) * cols
        ker._mma_kernel[tuple(grid)](x2, packed, scale_u8, gs, bias_arg, y, part,
                                     _locks(x2.device, grid[0] * grid[1]), M, N, K, x2.stride(0) // 2, y.stride(0),
                                     packed.stride(0) // 4, scale_u8.stride(0), k_split, sa, sout, spart, sr, n_w, sk,
                                     ROW_TILES=rt, NUM_WARPS=nw, EVEN_K=K % 256 == 0 and k_split % 256 == 0,
                                     USE_ASM=x2.is_cuda and plan.get("asm", True), F16=x2.dtype == torch.float16,
                                     SIDE_COLS=cols, SIDE_SPLIT=sside, SIDE_PAD=triton.next_power_of_2(sside),
                                     SIDE_F32=not x2.is_cuda, W_EARLY=constant_weight, **pdl_opts(x2.device),
                                     num_warps=nw, num_stages=plan.get("num_stages", 1), **flags)
        return (y, sout) if side is not None else y  # (the mma kernel reduces its own split-K partials)
    args = (x2, packed, scale_u8, gs, bias_arg, y, part, M, N, K, x2.stride(0), y.stride(0), packed.stride(0),
            scale_u8.stride(0), k_split)
    common = dict(EVEN_K=k_split * split == K, **flags, **_launch_opts(plan))
    if plan["kernel"] == "gemv":
        grid = (triton.cdiv(N, plan["BLOCK_N"]), M, split)
        # On the GPU the decode is the PTX on 32-bit words (whatever x's dtype); the interpreter runs the
        # plain Triton decode.
        ker._gemv_kernel[grid](*args, BLOCK_N=plan["BLOCK_N"], BLOCK_K=bk, X16=_pairs_aligned(x2),
                               X_IS_BF16=x2.dtype == torch.bfloat16,
                               USE_ASM=plan.get("asm", True) and x2.is_cuda and _words_aligned(packed), **common)
    else:
        grid = (triton.cdiv(M, plan["BLOCK_M"]) * triton.cdiv(N, plan["BLOCK_N"]), split)
        ker._tiled_kernel[grid](*args, BLOCK_M=plan["BLOCK_M"], BLOCK_N=plan["BLOCK_N"], BLOCK_K=bk,
                                GROUP_M=plan["GROUP_M"], **_tile_opts(x2, plan), **common)
    if split > 1:
        block = 1024
        ker._splitk_reduce_kernel[(triton.cdiv(M * N, block),)](part, gs, bias_arg, y, M, N, y.stride(0),
                                                                BLOCK=block, num_warps=4, **flags)
    return y


def triton_dx(g2, packed, scale_u8, gs, plan=None):
    """dX (M, K) = g2 (M, N) @ W on the Triton path."""
    M, N = g2.shape
    K = packed.shape[1] * 2
    plan = plan or plan_dx(M, N, K, g2.dtype, g2.device)
    if plan["kernel"] == "dequant":
        return g2 @ dequantize_triton(packed, scale_u8, gs, g2.dtype, plan.get("DQ"))
    dx = torch.empty(M, K, dtype=g2.dtype, device=g2.device)
    if M == 0:
        return dx
    bm, bn, bk = plan["BLOCK_M"], plan["BLOCK_N"], plan["BLOCK_K"]
    grid = (triton.cdiv(M, bm) * triton.cdiv(K, bk),)
    _kernels(g2.device)._tiled_dx_kernel[grid](
        g2, packed, scale_u8, gs, dx, M, N, K, g2.stride(0), dx.stride(0),
        packed.stride(0), scale_u8.stride(0), BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        GROUP_M=plan["GROUP_M"], GS_PER_ROW=gs.numel() > 1, EVEN_N=N % bn == 0, EVEN_K=K % bk == 0,
        **_tile_opts(g2, plan), **_launch_opts(plan))
    return dx


# ---------------------------------------------------------------------------------------------
# The op: torch.ops.qerl.fp4_linear (opaque to torch.compile, differentiable in x and bias)
# ---------------------------------------------------------------------------------------------

def _check(x, packed, scale, gs):
    n, k = packed.shape[0], packed.shape[1] * 2
    if x.shape[-1] != k or scale.shape != (n, k // nvfp4.BLOCK) or gs.numel() not in (1, n):
        raise ValueError(f"fp4_linear: x {tuple(x.shape)} against packed {tuple(packed.shape)}, scale "
                         f"{tuple(scale.shape)}, global_scale {tuple(gs.shape)}")


@torch.library.custom_op("qerl::fp4_linear", mutates_args=())
def _fp4_linear_op(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                   bias: Optional[torch.Tensor]) -> torch.Tensor:
    _check(x, packed, scale, global_scale)
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if _use_triton(x):
        y = triton_linear(x2, packed, scale.view(torch.uint8), global_scale.float(), bias)
    else:
        y = _torch_linear(x2, packed, scale, global_scale, bias)
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
    if _use_triton(grad):
        dx = triton_dx(g2, packed, scale.view(torch.uint8), global_scale.float())
    else:
        dx = _torch_dx(g2, packed, scale, global_scale)
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


def side_rides_along(x, q):
    """Whether fp4_linear_side(x, q, ...) computes its side product inside the GEMM's own launch (the mma
    kernel's plan: one row on a Hopper GPU, up to 8 on others) rather than in a launch of its own."""
    return (x.is_cuda and _use_triton(x)
            and _side_rides(_runnable_plan(x, q.packed, q.scale.view(torch.uint8)), x.shape[0]))


def fp4_linear_side(x, q, bias, side):
    """Decode's (x @ dequantize(q).T + bias, x @ side.T) for 2-D x and a small dense side (SR, K) in x's
    dtype (rollout: a group's LoRA A's). With the mma kernel (up to 8 rows) both come from one
    launch, the side's programs after the weight's: on the Qwen2.5-7B shapes the launch takes 0.4-3 us
    longer than the GEMM alone, where a launch of small_linear of its own took 4.2-8.2 us (H200,
    results/rollout_h200.md). Other kernels: the GEMM, then small_linear (or cuBLAS) for the side;
    rollout.py computes those rows' side products with cuBLAS on a second stream instead, beside the
    GEMM. Not differentiable. The kernel just before in the stream must not write q (a decode step's
    weights are constants): the mma kernel loads its first codes before its launch wait."""
    _check(x, q.packed, q.scale, q.global_scale)
    if x.dim() != 2 or side.shape[1] != x.shape[1] or side.dtype != x.dtype:
        raise ValueError(f"fp4_linear_side: x {tuple(x.shape)} {x.dtype} against side {tuple(side.shape)} {side.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if _use_triton(x):
        return triton_linear(x, q.packed, q.scale.view(torch.uint8), q.global_scale.float(), bias, side=side,
                             constant_weight=True)
    return _torch_linear(x, q.packed, q.scale, q.global_scale, bias), torch.nn.functional.linear(x, side)


def _k_step_of(plan):
    """The k-step of a warp-specialized wgmma plan (its x in that K order), else 0."""
    return plan["BLOCK_K"] if plan["kernel"] == "wgmma" and "STAGES" in plan else 0


def x_k_order(M, q, dtype, device):
    """For M rows of x in `dtype` against the NVFP4 weight q: (k_step, rows) where the plan's kernel is the
    warp-specialized wgmma one (33-256 rows on Hopper), which reads x in the K order (wgmma_k_order) of
    its k-steps and in whole tiles of rows; else (0, M). A caller whose own kernel produces x may store it
    in that order (k_ordered_tile), as the first M rows of a buffer of `rows`, and call
    fp4_linear_k_ordered, which then skips the K-order launch: rollout's decode step, where that took a
    7B step at 64 rows from 4.41-4.54 to 4.29-4.36 ms and at 128 from 6.55 to 6.23 (H200,
    results/rollout_h200.md, session 20). The plain wgmma kernel (2-32 rows) is not offered: there the
    step was 3-6% slower without the K-order launch (probably because the GEMM then follows the fork of
    rollout's second stream directly, which the K-order launch used to absorb; not looked into)."""
    N, K = q.packed.shape[0], q.packed.shape[1] * 2
    if device.type != "cuda" or _choice["backend"] == "torch" or not HAS_TRITON:
        return 0, M
    plan = plan_forward(M, N, K, dtype, device)
    if not (_k_step_of(plan) and _tma_fits(q.packed, q.scale.view(torch.uint8))):
        return 0, M
    return _k_step_of(plan), _x_rows(M, plan)


def fp4_linear_k_ordered(x, q, bias=None):
    """x @ dequantize(q).T + bias for 2-D x stored as x_k_order(len(x), q, ...) says (its k_step > 0):
    the warp-specialized wgmma kernel without the launch that orders x. Not differentiable; rollout's
    decode step."""
    _check(x, q.packed, q.scale, q.global_scale)
    return triton_linear(x, q.packed, q.scale.view(torch.uint8), q.global_scale.float(), bias, x_k_ordered=True)


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
    def from_linear(cls, linear, name="weight"):
        m = cls(linear.in_features, linear.out_features, linear.bias is not None,
                device=linear.weight.device, dtype=linear.weight.dtype)
        m.set_weight(linear.weight.data, name)
        if linear.bias is not None:
            m.bias.data.copy_(linear.bias.data)
        return m

    def set_weight(self, w, name="weight"):
        """Quantize the (N, K) float weight w into this layer's buffers, in place."""
        q = nvfp4.quantize(w, name=name)
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


def quantize_model(model, filter=is_decoder_linear):
    """Swap every decoder nn.Linear of `model` (a model.Transformer) for a QuantLinear, in place."""
    return model.swap_linears(lambda name, m: QuantLinear.from_linear(m, name=name + ".weight"), filter)


# ---------------------------------------------------------------------------------------------
# Benchmark and tuning on the GPU: python fp4_gemm.py --bench | --tune
# ---------------------------------------------------------------------------------------------

# Qwen2.5-7B's linears: name → (in_features, out_features of the layers fused into one matmul, bias).
QWEN7B_SHAPES = {"qkv": (3584, (3584, 512, 512), True), "o": (3584, (3584,), False),
                 "gate_up": (3584, (18944, 18944), False), "down": (18944, (3584,), False)}
BENCH_M = (1, 4, 16, 64, 256, 1024, 4096)
ROTATE_BYTES = 256 * 2**20  # weights touched per timed graph: several times the 50 MB L2


def _bench_layer(K, parts, bias, seed=0):
    """A random Qwen-like layer on the GPU, quantized part by part and fused (per-row global scales)."""
    torch.manual_seed(seed)
    layers = []
    for n in parts:
        lin = nn.Linear(K, n, bias=bias, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02)
            if bias:
                lin.bias.normal_(0, 0.1)
        layers.append(QuantLinear.from_linear(lin))
    return QuantLinear.concat(layers) if len(layers) > 1 else layers[0]


def _graph_ms(calls):
    """Median ms per call: the calls run back to back in one CUDA graph (no launch gaps), the graph
    replayed by triton.testing.do_bench (which also flushes L2 between replays)."""
    for c in calls:  # compile and warm up outside the graph
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median")
    del graph
    return ms / len(calls)


def _copies(nbytes):
    return max(1, math.ceil(ROTATE_BYTES / nbytes))


def _ours_calls(layer, M, plan, direction, x):
    """Closures launching our kernel on rotated copies of the weight."""
    wbytes = layer.weight_packed.numel() + layer.weight_scale.numel()
    calls = []
    for _ in range(_copies(wbytes)):
        p, s = layer.weight_packed.clone(), layer.weight_scale.view(torch.uint8).clone()
        gs, b = layer.weight_global_scale.float(), layer.bias
        if direction == "fwd":
            calls.append(lambda p=p, s=s: triton_linear(x, p, s, gs, b, plan))
        else:
            calls.append(lambda p=p, s=s: triton_dx(x, p, s, gs, plan))
    return calls


def _cublas_calls(layer, direction, x):
    w = layer.dequantized_weight(torch.bfloat16)  # (N, K)
    b = layer.bias
    calls = []
    for _ in range(_copies(w.numel() * 2)):
        wc = w.clone()
        if direction == "fwd":
            calls.append(lambda wc=wc: torch.nn.functional.linear(x, wc, b))
        else:
            calls.append(lambda wc=wc: x @ wc)
    return calls


def _rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def _reference(layer, x, direction):
    w = layer.dequantized_weight(torch.float32)
    if direction == "fwd":
        y = x.float() @ w.t()
        return y + layer.bias.float() if layer.bias is not None else y
    return x.float() @ w


def _candidates(M, N, K, direction):
    """Launch configs worth timing for one problem (what --tune sweeps; plan_forward holds the winners)."""
    dq = [dict(kernel="dequant", DQ=c) for c in ((16, 256, 4), (16, 512, 4), (32, 512, 8), (8, 512, 4))]
    if direction == "dx":
        return dq + [dict(kernel="tiled", BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)]
    c = []
    if M <= 8:
        for rt, w in ((1, 4), (1, 8), (2, 4)):
            for split in (1, 2, 4, 8, 16):
                c.append(dict(kernel="mma", ROW_TILES=rt, num_warps=w, SPLIT_K=split))
    if M == 1:
        for bn, bk, w in ((8, 512, 4), (8, 256, 2), (16, 512, 4), (32, 512, 4)):
            for split in (1, 2, 4):
                if split == 1 or triton.cdiv(N, bn) * split <= 1800:
                    c.append(dict(kernel="gemv", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=w, num_stages=1))
    if 1 < M <= 256:
        for bt in [_wgmma_rows_of_x(min(M, 64), N, K)] + ([128] if M > 64 else []):
            for bk in (128, 256):
                if K % bk == 0:
                    for split in (1, 2, 4, 8, 16):
                        c.append(dict(kernel="wgmma", BT=bt, BLOCK_K=bk, SPLIT_K=split))
    # the warp-specialized wgmma: rings of 2 or 4 stages, one to three consumer warpgroups (at 1-8 rows, 8-row
    # tiles with rings of 4 or 6 stages lost to the mma kernel and to the plain wgmma kernel: session 13)
    if K % 256 == 0 and 8 < M <= 256:
        for bt in [_wgmma_rows_of_x(min(M, 64), N, K)] + ([128] if M > 64 else []):
            for nwg in (1, 2, 3):
                for stages in (2, 4):
                    tiles = dict(kernel="wgmma", BT=bt, BLOCK_K=256, STAGES=stages, NWG=nwg)
                    if _ws_ring_bytes(tiles) <= 220 * 1024:
                        c += [dict(tiles, SPLIT_K=s) for s in (1, 2, 3, 4, 8) + ((16,) if K >= 8192 else ())]
                        last = _last_wave_split(tiles, M, N, K, torch.device("cuda"))  # (its own SPLIT_K)
                        c += [dict(tiles, **last)] if last else []
    if K % 256 == 0 and M > 64:  # the persistent variant (unsplit, two or three consumer warpgroups), with
        # stream-K or not
        c += [dict(kernel="wgmma", BT=128, BLOCK_K=256, SPLIT_K=1, STAGES=2, NWG=nwg, PERSIST=True, GROUP_M=g, **s)
              for nwg in (2, 3) for g in (4, 8, 16) for s in ({}, dict(STREAM=True))]
    if 16 < M <= 64:
        for bm in (32, 64) if M <= 32 else (64,):
            for bn in (32, 64, 128):
                for split in (1, 2, 4, 8):
                    c.append(dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, SPLIT_K=split,
                                  num_warps=4, num_stages=3))
    if 1 < M <= 32:
        for bn, bk, st, splits in ((32, 256, 4, (1, 4)), (64, 256, 3, (1, 2)), (64, 128, 4, (1, 2, 4)),
                                   (128, 128, 4, (4,))):
            for split in splits:
                c.append(dict(kernel="tiled", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split,
                              num_warps=4, num_stages=st))
    if 32 < M <= 512:
        for bm, bn, bk, w, st in ((64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3)):
            if bm <= max(64, M // 2):
                for split in (1, 2):
                    if split == 1 or triton.cdiv(M, bm) * triton.cdiv(N, bn) < 132:
                        c.append(dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split,
                                      num_warps=w, num_stages=st))
    if M >= 128:
        c += dq
    if M > 512:
        c.append(dict(kernel="tiled", BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8,
                      num_stages=3))
    return c


def _problems(ms, with_dx=True):
    for M in ms:
        for name in QWEN7B_SHAPES:
            yield name, M, "fwd"
    if with_dx:
        for name in QWEN7B_SHAPES:
            yield name, 4096, "dx"


_LAYERS = {}


def _layer_for(name):
    if name not in _LAYERS:
        K, parts, bias = QWEN7B_SHAPES[name]
        _LAYERS[name] = _bench_layer(K, parts, bias, seed=len(_LAYERS))
    return _LAYERS[name]


def _run_one(name, M, direction, plan, x=None):
    layer = _layer_for(name)
    K, N = layer.in_features, layer.out_features
    if x is None:
        x = torch.randn(M, N if direction == "dx" else K, device="cuda", dtype=torch.bfloat16)
    args = (layer.weight_packed, layer.weight_scale.view(torch.uint8), layer.weight_global_scale.float())
    if direction == "fwd":
        return triton_linear(x, *args, layer.bias, plan)
    return triton_dx(x, *args, plan)


def _warm(task):
    """Worker: compile one config by running it once (fills Triton's on-disk cache)."""
    name, M, direction, plan = task
    try:
        _run_one(name, M, direction, plan)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported by the parent
        return f"{name} M={M} {direction} {plan}: {type(e).__name__}: {str(e)[:300]}"


def _precompile(tasks, jobs):
    """Compile many configs in parallel processes before timing them one by one."""
    import concurrent.futures
    import multiprocessing

    errors = []
    if jobs <= 1:
        return [e for e in map(_warm, tasks) if e]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        for err in pool.map(_warm, tasks, chunksize=max(1, len(tasks) // (4 * jobs))):
            if err:
                errors.append(err)
    return errors


def _copy_bandwidth():
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    return 2 * a.numel() / ms / 1e9  # TB/s, bytes read + written


def _measure(name, M, direction, plans, log):
    """Check every plan against the float reference, time it and cuBLAS; returns result rows."""
    layer = _layer_for(name)
    K, N = layer.in_features, layer.out_features
    x = torch.randn(M, N if direction == "dx" else K, device="cuda", dtype=torch.bfloat16)
    ref = _reference(layer, x, direction)
    out_dim = K if direction == "dx" else N
    nbytes = layer.weight_packed.numel() + layer.weight_scale.numel() + 2 * x.numel() + 2 * M * out_dim
    flops = 2 * M * N * K
    cublas = _cublas_calls(layer, direction, x)
    t_cublas = _graph_ms(cublas)
    err_cublas = _rel_err(cublas[0](), ref)
    rows = []
    for plan in plans:
        try:
            err = _rel_err(_run_one(name, M, direction, plan, x), ref)
            t = _graph_ms(_ours_calls(layer, M, plan, direction, x)) if err < 2e-2 else float("nan")
        except Exception as e:
            log(f"  FAILED {name} M={M} {direction} {plan}: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(dict(shape=name, M=M, N=N, K=K, direction=direction, plan=plan, ms=t, err=err,
                         cublas_ms=t_cublas, cublas_err=err_cublas, tbps=nbytes / t / 1e9, tflops=flops / t / 1e9,
                         ratio=t_cublas / t))
    return rows


def _kernel_label(p):
    """A plan as the table's kernel column: 'mma 64 rows split4 w4', 'tiled 16x64x128 split4 w4s4', ..."""
    split = f" split{p['SPLIT_K']}" if p.get("SPLIT_K", 1) > 1 else ""
    split += f" after {p['WHOLE']} whole" if p.get("WHOLE") else ""
    if p["kernel"] == "dequant":
        return "dequant+cuBLAS" + (" {}x{} w{}".format(*p["DQ"]) if p.get("DQ") else "")
    if p["kernel"] == "mma":
        return f"mma {16 * p['num_warps'] * p['ROW_TILES']} rows{split} w{p['num_warps']}"
    if p["kernel"] == "wgmma":
        ws = f" ws{p['STAGES']}" + (f"x{p['NWG']}wg" if p.get("NWG", 1) > 1 else "") if "STAGES" in p else ""
        ws += f" persistent g{p['GROUP_M']}" + (" stream-K" if p.get("STREAM") else "") if p.get("PERSIST") else ""
        return f"wgmma {64 * p.get('NWG', 1)}x{p['BT']}x{p['BLOCK_K']}{split}{ws}"
    return (f"{p['kernel']} {p.get('BLOCK_M', 1)}x{p['BLOCK_N']}x{p['BLOCK_K']}{split}"
            + (" plain-decode" if p.get("asm") is False else "") + f" w{p.get('num_warps')}s{p.get('num_stages')}")


def _table(rows, copy_tbps, device=None):
    lines = [f"Device: {device or torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
             f"device copy {copy_tbps:.2f} TB/s (read + write). Times: median of CUDA-graph replays over rotated "
             f"weight copies (≥ {ROTATE_BYTES >> 20} MiB a replay, L2 flushed between replays). TB/s counts packed "
             "weight + scales + x + y bytes; ratio = cuBLAS bf16 time / ours (> 1: we are faster).", "",
             "| layer | N x K | M | pass | kernel | ours µs | cuBLAS µs | ratio | TB/s | TFLOP/s | rel err (ours / cuBLAS) |",
             "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['N']} x {r['K']} | {r['M']} | {r['direction']} | {_kernel_label(r['plan'])} | "
                     f"{r['ms'] * 1e3:.1f} | {r['cublas_ms'] * 1e3:.1f} | {r['ratio']:.2f} | {r['tbps']:.2f} | "
                     f"{r['tflops']:.0f} | {r['err']:.1e} / {r['cublas_err']:.1e} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description="NVFP4 W4A16 kernels: benchmark against cuBLAS bf16 on "
                                                 "Qwen2.5-7B's layer shapes, or sweep launch configs.")
    parser.add_argument("--bench", action="store_true", help="time the per-shape table's choice vs cuBLAS bf16 and "
                                                             "print a markdown table")
    parser.add_argument("--tune", action="store_true", help="time every candidate config per problem; print the best")
    parser.add_argument("--m", type=int, nargs="*", default=list(BENCH_M), help="batch sizes (rows of x) to run")
    parser.add_argument("--shapes", nargs="*", default=list(QWEN7B_SHAPES), help="layers to run")
    parser.add_argument("--no-dx", action="store_true", help="skip the dX backward at M=4096")
    parser.add_argument("--kernel", choices=[k for k in KERNELS if k], help="--tune: only this kernel's configs")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="processes compiling kernels in parallel before timing")
    parser.add_argument("--out", default=None, help="also write the table (.md) and all rows (.jsonl) here")
    args = parser.parse_args()
    if not (args.bench or args.tune):
        parser.error("nothing to do: pass --bench or --tune")
    if not torch.cuda.is_available() or not HAS_TRITON:
        raise SystemExit("--bench/--tune need a CUDA GPU and triton")
    import json
    import time

    t0 = time.time()
    log = lambda s: print(s, flush=True)
    probs = [p for p in _problems(args.m, not args.no_dx) if p[0] in args.shapes]
    plans = {}
    for name, M, d in probs:
        K, parts, _ = QWEN7B_SHAPES[name]
        N = sum(parts)
        dev = torch.device("cuda")
        chosen = plan_forward(M, N, K, torch.bfloat16, dev) if d == "fwd" else plan_dx(M, N, K, torch.bfloat16, dev)
        plans[(name, M, d)] = ([p for p in _candidates(M, N, K, d) if args.kernel in (None, p["kernel"])] if args.tune
                               else [chosen])
    tasks = [(n, M, d, p) for (n, M, d), ps in plans.items() for p in ps if p["kernel"] != "dequant"]
    log(f"{len(probs)} problems, {len(tasks)} kernel launches to compile on {args.jobs} processes")
    for e in _precompile(tasks, args.jobs):
        log("  compile/run error: " + e)
    log(f"compiled in {time.time() - t0:.0f} s")
    copy = _copy_bandwidth()
    log(f"device copy bandwidth: {copy:.2f} TB/s")
    rows, best = [], []
    jsonl = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        jsonl = open(os.path.join(args.out, f"fp4_gemm_{'tune' if args.tune else 'bench'}.jsonl"), "w")
    for (name, M, d), ps in plans.items():
        r = _measure(name, M, d, ps, log)
        rows += r
        if jsonl:  # written as we go: a run cut short still leaves its numbers
            for x in r:
                jsonl.write(json.dumps(x) + "\n")
            jsonl.flush()
        ok = [x for x in r if x["ms"] == x["ms"]]
        if ok:
            b = min(ok, key=lambda x: x["ms"])
            best.append(b)
            log(f"{name:8s} M={M:5d} {d}: best {b['ms'] * 1e3:8.1f} us  cuBLAS {b['cublas_ms'] * 1e3:8.1f} us  "
                f"ratio {b['ratio']:.2f}  {b['tbps']:.2f} TB/s  err {b['err']:.1e}  {b['plan']}")
            if args.tune:
                for x in sorted(ok, key=lambda x: x["ms"])[:6]:
                    log(f"      {x['ms'] * 1e3:8.1f} us  {x['plan']}")
    table = _table(best, copy)
    print(table)
    log(f"total {time.time() - t0:.0f} s")
    if args.out:
        jsonl.close()
        with open(os.path.join(args.out, f"fp4_gemm_{'tune' if args.tune else 'bench'}.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
