"""The decode kernels for a few rows of x: the tensor-core GEMV (mma.sync, Marlin's idea) and the fp32 GEMV.

Speeds up: fp4_gemm.fp4_linear at 1-8 rows of x (decode), where the portable tiled kernel wastes most of
a 16-row tile and leaves the decode's issue slots as the bound. `_mma_kernel` feeds decoded weights
straight from each lane's registers into mma.sync (no data crosses lanes), splits K and sums the
partials itself (an atomic ticket, deterministic order), and can carry a small dense product (a
LoRA A) as extra programs of the same launch (engine/side.py). `_gemv_kernel` serves one row of fp32 x.
Tested against: fp4_gemm's torch reference in float64, under the interpreter on CPU (each PTX block
has a plain-Triton model, `_mma_half_reference`, that the interpreter runs); on a GPU the PTX is held to
that model within rounding (the two accumulate in fp32 in different orders before the 16-bit output)
and to the float64 reference (tests/engine/test_mma.py). Measurements: results/fp4_gemm_h200.md.
"""
import triton
import triton.language as tl

from engine.pdl import pdl_launch_next, pdl_wait
from engine.ptx import _ASM_MMA, _ASM_WORD, _MMA_CONSTRAINTS
from fp4_gemm import decode_plain, e2m1_to_f32, e4m3_to_f32, finish_tile, scale_bias, w_pairs


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
def _gemv_kernel(x_ptr, wp_ptr, ws_ptr, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, K, stride_xm, stride_ym,
                 stride_wn, stride_sn, k_split, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, GS_PER_ROW: tl.constexpr, HAS_BIAS: tl.constexpr,
                 EVEN_K: tl.constexpr, USE_ASM: tl.constexpr, X16: tl.constexpr, X_IS_BF16: tl.constexpr):
    """Decode GEMV: program (n, m, s) owns BLOCK_N weight rows, one row of x and one K split (fp32
    FMAs, no tensor cores). On the GPU (USE_ASM) the codes are read as 32-bit words of 8 and a
    (BN, BK/16) tile of block partials keeps every decoded value in the thread that decoded it: no
    layout change, one reduction at the end. Elsewhere even and odd k are kept apart the same way.
    (Variants tried and dropped: results/fp4_gemm_h200.md.)"""
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
            acc += tl.sum(part, axis=2) * e4m3_to_f32(sb, 16384.0)  # (e2m1 2^-14)(s 2^6) = e2m1 s 2^-8
        out = tl.sum(acc, axis=1)[None, :]  # (1, BN)
    else:
        acc_e = tl.zeros((BLOCK_N, BLOCK_K // 2), tl.float32)
        acc_o = tl.zeros((BLOCK_N, BLOCK_K // 2), tl.float32)
        for k0 in range(k_lo, k_lo + k_split, BLOCK_K):
            lo, hi = w_pairs(wp_ptr, ws_ptr, stride_wn, stride_sn, rows, k0, K, BLOCK_N, BLOCK_K, EVEN_K,
                             decode_plain, tl.float32)  # (BN, BK/2) each
            xe, xo = _x_pairs(x_rows, k0, K, BLOCK_K, EVEN_K, X16, X_IS_BF16)  # (1, BK/2) each
            acc_e += lo * xe
            acc_o += hi * xo
        out = tl.sum(acc_e + acc_o, axis=1)[None, :]  # (1, BN)
    offs_m = pid_m + tl.arange(0, 1)
    finish_tile(out, offs_m, offs_n, pid_k, gs_ptr, bias_ptr, y_ptr, part_ptr, M, N, stride_ym,
                SPLIT_K, GS_PER_ROW, HAS_BIAS)


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
# what bounds this kernel; decoding is. The PTX block (engine/ptx.py, _mma_asm) decodes the lane's
# words and runs the MMAs; _mma_half_reference is its plain-Triton model for the interpreter.


@triton.jit
def _mma_rows_reference(q, s, xv, HALF: tl.constexpr, NUM_WARPS: tl.constexpr, ROW_TILES: tl.constexpr):
    """One row of each lane's pair (g or g + 8): (R, L) sums at tokens 2t and 2t + 1."""
    s16 = tl.reshape(s.to(tl.uint16), (ROW_TILES, 32 * NUM_WARPS, 2, 2))  # (R, L, half, block)
    s_lo, s_hi = tl.split(s16)  # (R, L, 2) each: byte 2 * half + 0 / + 1
    lo_h0, lo_h1 = tl.split(s_lo)
    hi_h0, hi_h1 = tl.split(s_hi)
    if HALF:
        sc = tl.join(e4m3_to_f32(lo_h1, 16384.0), e4m3_to_f32(hi_h1, 16384.0))  # (R, L, 2): * 2^6
    else:
        sc = tl.join(e4m3_to_f32(lo_h0, 16384.0), e4m3_to_f32(hi_h0, 16384.0))
    sc = tl.reshape(tl.broadcast_to(tl.reshape(sc, (ROW_TILES, 32 * NUM_WARPS, 2, 1)),
                                    (ROW_TILES, 32 * NUM_WARPS, 2, 2)), (ROW_TILES, 32 * NUM_WARPS, 4, 1))
    i = tl.arange(0, 8)[None, None, None, :]
    wv = e2m1_to_f32(((q[:, :, :, None] >> (4 * i)) & 0xF).to(tl.uint16)) * sc  # (R, L, 4, 8): k = 8 w + i
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
        acc = scale_bias(acc, rows % N, gs_ptr, bias_ptr, GS_PER_ROW, HAS_BIAS)
        tl.store(y_ptr + toks.to(tl.int64) * stride_ym + rows, acc.to(y_ptr.dtype.element_ty), mask=mask)

