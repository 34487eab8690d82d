"""The decode engine's fused Triton kernels: the small ops between a decode step's GEMMs, one launch each.

Speeds up: the torch ops of one decode step of rollout.py's sampler (the model's residual adds and
RMSNorms, rotary embedding, attention over the KV cache, SiLU·up, the LoRA B products, and
rollout.sample_reference), which as eager torch cost ~25 launches a layer. engine/decode.py launches
these; each has its torch form next to its launch there (Decoder, kernels="torch"). Tested against
rollout.py's sampler and those torch forms: tests/engine/test_decode.py (on CPU under TRITON_INTERPRET=1,
bit-identical on the GPU with and without programmatic dependent launch). Measurements:
results/rollout_h200.md.

Every kernel calls pdl_wait (engine/pdl.py) before it reads what an earlier kernel of the step writes;
what no kernel of the step writes (LoRA B's, a norm's weight) is loaded before the wait, so those loads
overlap the kernel before. A kernel whose output feeds a warp-specialized wgmma GEMM can store it in
that GEMM's K order (K_STEP, engine/korder.py).
"""
import triton
import triton.language as tl

from engine.fp8 import round_e4m3
from engine.korder import k_ordered_tile
from engine.pdl import pdl_launch_next, pdl_wait


@triton.jit
def _add_rmsnorm_kernel(x_ptr, d_ptr, w_ptr, xout_ptr, out_ptr, H, eps,
                        HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr, K_STEP: tl.constexpr, PDL: tl.constexpr):
    """One row: x += delta (rounded to the model dtype, as the model's residual add), then RMSNorm (stored
    in the next GEMM's K order if K_STEP: see Decoder.gemm)."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < H
    pdl_launch_next(PDL)  # the GEMM after this one may start loading its weights
    w = tl.load(w_ptr + offs, mask=m, other=0.0)  # (no kernel of the step writes it: loaded before the wait)
    pdl_wait(PDL)
    x = tl.load(x_ptr + row * H + offs, mask=m, other=0.0)
    if HAS_DELTA:
        dx = tl.load(d_ptr + row * H + offs, mask=m, other=0.0)
        x = (x.to(tl.float32) + dx.to(tl.float32)).to(xout_ptr.dtype.element_ty)
        tl.store(xout_ptr + row * H + offs, x, mask=m)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    y = (xf * tl.rsqrt(var + eps) * w).to(out_ptr.dtype.element_ty)
    if K_STEP:  # (H a multiple of K_STEP: the padding past H stays past H)
        y = tl.reshape(k_ordered_tile(tl.reshape(y, (1, BLOCK)), 1, BLOCK, K_STEP), (BLOCK,))
    tl.store(out_ptr + row * H + offs, y, mask=m)


@triton.jit
def _rope_write_kernel(qkv_ptr, a_ptr, b_ptr, cos_ptr, sin_ptr, pad_ptr, counters_ptr, q_ptr, kc_ptr, vc_ptr, ks_ptr,
                       vs_ptr, M, S, Hq, Hkv, A_STRIDE, T, COPIES, ROW0, D: tl.constexpr, R: tl.constexpr,
                       BM: tl.constexpr, HAS_LORA: tl.constexpr, PREC: tl.constexpr, PROMPT: tl.constexpr,
                       FP8: tl.constexpr, PDL: tl.constexpr):
    """Program (row block, head j of q|k|v): add the head's LoRA B product, rotate q and k by their
    positions, store q to q_ptr (M, Hq, D) and k / v into this layer's cache. A decode step (PROMPT false):
    row m is sequence m, its token at the current column. A prefill (PROMPT): row m is token t = m % T of
    prompt p = m // T (left-padded by pad[p]) at column t, its k / v into cache rows ROW0 + p·COPIES ...
    + COPIES − 1 (the prompt's samples). FP8: the cache holds E4M3, each (row, head, column)'s scale in
    ks / vs (rollout.kv_e4m3's arithmetic, on the value rounded to the model dtype)."""
    pm = tl.program_id(0)
    j = tl.program_id(1)
    HALF: tl.constexpr = D // 2
    rows = pm * BM + tl.arange(0, BM)
    rm = rows < M
    if PROMPT:
        p = rows // T
        t = rows % T
    else:
        p = rows
        t = rows * 0  # (the column is the current one for every row)
    d = tl.arange(0, HALF)
    nqkv = (Hq + 2 * Hkv) * D
    c0 = j * D
    r = tl.arange(0, R)
    if HAS_LORA:  # B^T for this head's two halves (R, HALF): no kernel of the step writes it, so before the wait
        b1 = tl.load(b_ptr + (c0 + d)[None, :] * R + r[:, None])
        b2 = tl.load(b_ptr + (c0 + HALF + d)[None, :] * R + r[:, None])
    pdl_wait(PDL)
    x1 = tl.load(qkv_ptr + rows[:, None] * nqkv + c0 + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + rows[:, None] * nqkv + c0 + HALF + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
    if HAS_LORA:
        sec = (j >= Hq).to(tl.int32) + (j >= Hq + Hkv).to(tl.int32)  # which of A_q, A_k, A_v fed this head
        a = tl.load(a_ptr + rows[:, None] * A_STRIDE + sec * R + r[None, :], mask=rm[:, None], other=0.0)  # (BM, R)
        x1 += tl.dot(a, b1, input_precision=PREC)
        x2 += tl.dot(a, b2, input_precision=PREC)
    dt = q_ptr.dtype.element_ty
    x1 = x1.to(dt).to(tl.float32)  # the projection's output in the model dtype, as the model rounds it
    x2 = x2.to(dt).to(tl.float32)
    col = t if PROMPT else t + tl.load(counters_ptr)  # (BM,)
    if j < Hq + Hkv:  # q and k are rotated: (x1, x2) → (x1 cos − x2 sin, x2 cos + x1 sin)
        pos = tl.maximum(col - tl.load(pad_ptr + p, mask=rm, other=0), 0)  # (a prompt's padding: position 0)
        c = tl.load(cos_ptr + pos[:, None] * HALF + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        s = tl.load(sin_ptr + pos[:, None] * HALF + d[None, :], mask=rm[:, None], other=0.0).to(tl.float32)
        y1 = (x1 * c - x2 * s).to(dt)
        y2 = (x2 * c + x1 * s).to(dt)
    else:
        y1 = x1.to(dt)
        y2 = x2.to(dt)
    if j < Hq:
        dst = q_ptr + rows[:, None] * (Hq * D) + j * D
        tl.store(dst + d[None, :], y1, mask=rm[:, None])
        tl.store(dst + HALF + d[None, :], y2, mask=rm[:, None])
    else:
        cache, scales = kc_ptr, ks_ptr
        h = j - Hq
        if j >= Hq + Hkv:
            cache, scales = vc_ptr, vs_ptr
            h = j - Hq - Hkv
        for c in range(COPIES):
            _store_kv(cache, scales, ((ROW0 + p * COPIES + c) * Hkv + h) * S + col, y1, y2, rm, BM, D, FP8)


@triton.jit
def _store_kv(cache, scales, at, y1, y2, rm, BM: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr):
    """The two halves y1, y2 (BM, D/2) of BM keys or values into the cache at (row, head, column) `at` (BM,).
    FP8: amax / 448 over each one's D values into `scales`, the values times 448 / amax rounded to E4M3."""
    HALF: tl.constexpr = D // 2
    d = tl.arange(0, HALF)
    dst = cache + (at * D)[:, None]
    if FP8:
        f1, f2 = y1.to(tl.float32), y2.to(tl.float32)
        amax = tl.maximum(tl.maximum(tl.max(tl.abs(f1), 1), tl.max(tl.abs(f2), 1)), 1e-30)  # (BM,)
        inv = tl.math.div_rn(tl.full([BM], 448.0, tl.float32), amax)[:, None]  # IEEE divisions, as torch's
        tl.store(dst + d[None, :], round_e4m3(f1 * inv).to(cache.dtype.element_ty), mask=rm[:, None])
        tl.store(dst + HALF + d[None, :], round_e4m3(f2 * inv).to(cache.dtype.element_ty), mask=rm[:, None])
        tl.store(scales + at, tl.math.div_rn(amax, tl.full([BM], 448.0, tl.float32)), mask=rm)
    else:
        tl.store(dst + d[None, :], y1, mask=rm[:, None])
        tl.store(dst + HALF + d[None, :], y2, mask=rm[:, None])




@triton.jit
def _attn_part(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, m_ptr, l_ptr, acc_ptr, qrow, qm, base, lo, hi, out, sm_scale,
               QP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr):
    """Online softmax of the QP query rows `qrow` (mask qm) over the cache columns [lo, hi) at `base` (one
    row's one kv head); its max, sum and weighted values stored at `out` (the values only if a column was
    read: the combine does not read them from an empty slot).

    FP8: the cache's E4M3 keys and values, with their column's scale (ks / vs at base / D) multiplied in where
    it factors out: a key's into its column of scores, a value's into its column's softmax weight. A 16-bit
    model's products then run in float16, which E4M3 converts to in one instruction a pair (to bf16 Triton
    takes several an element: results/fp8_kv.md): q divided by its row's largest element, the weights times
    the value scales by the block's largest scale, so that both sit in [-1, 1], and those factors multiplied
    back in float32."""
    d = tl.arange(0, D)
    q = tl.load(q_ptr + qrow[:, None] * D + d[None, :], mask=qm[:, None], other=0.0)  # (QP, D)
    if FP8:
        T = tl.float32 if q.dtype == tl.float32 else tl.float16
        qf = q.to(tl.float32)
        qmax = tl.maximum(tl.max(tl.abs(qf), 1), 1e-30)  # (QP,)
        q = (qf / qmax[:, None]).to(T)
        q_scale = qmax * sm_scale
    m_i = tl.full([QP], float("-inf"), tl.float32)
    l_i = tl.zeros([QP], tl.float32)
    acc = tl.zeros([QP, D], tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        nm = n < hi
        k = tl.load(kc_ptr + base + n[:, None] * D + d[None, :], mask=nm[:, None], other=0.0)  # (BLOCK_N, D)
        if FP8:
            sk = tl.load(ks_ptr + base // D + n, mask=nm, other=0.0)
            s = tl.dot(q, tl.trans(k.to(T)), input_precision=PREC) * q_scale[:, None] * sk[None, :]
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * sm_scale  # (QP, BLOCK_N)
        s = tl.where(nm[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vc_ptr + base + n[:, None] * D + d[None, :], mask=nm[:, None], other=0.0)
        if FP8:
            sv = tl.load(vs_ptr + base // D + n, mask=nm, other=0.0)
            top = tl.max(sv, 0)  # (> 0: the block holds a column, and a scale is at least 1e-30 / 448)
            pv = tl.dot((p * (sv / top)[None, :]).to(T), v.to(T), input_precision=PREC)
            acc = acc * alpha[:, None] + pv * top
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new
    tl.store(m_ptr + out, m_i, mask=qm)
    tl.store(l_ptr + out, l_i, mask=qm)
    # (the values only where a column was read; the masks combined at full shape, which the compiler and
    # every version of Triton's interpreter take)
    read = (tl.zeros([QP, D], tl.int32) + hi) > lo  # (QP, D)
    tl.store(acc_ptr + out[:, None] * D + d[None, :], acc, mask=qm[:, None] & read)


@triton.jit
def _attn_chunk(start, end, split, BLOCK_N: tl.constexpr):
    """Columns [lo, hi) of chunk `split` of num_programs(0) over [start, end): whole blocks of BLOCK_N,
    as even as that allows (the last chunks may be short or empty)."""
    per = tl.cdiv(tl.cdiv(end - start, tl.num_programs(0)), BLOCK_N) * BLOCK_N
    lo = start + split * per
    return lo, tl.minimum(lo + per, end)


@triton.jit
def _attn_row(r, M, N_GROUP: tl.constexpr, ROWS: tl.constexpr):
    """The row that the r-th of the M rows in launch order stands for. With groups (N_GROUP > 1, M a
    multiple of it), the rows whose programs also read their group's shared prompt (every ROWS-th row of
    a group: HP a group) come first, group after group, then the other rows in order: the GPU starts
    blocks in launch order, so the longer programs start in its first wave and the short ones fill in
    around them (at 64 rows, 8 a prompt: 512 programs, two waves; in the plain order some of the long
    ones ran in the second, and the step took 1.8% longer: results/engine_floor_h100.md)."""
    b = r
    if N_GROUP > 1:
        HP: tl.constexpr = (N_GROUP + ROWS - 1) // ROWS
        OTHERS: tl.constexpr = N_GROUP - HP if N_GROUP > HP else 1  # (ROWS = 1: every row reads the prompt)
        RL: tl.constexpr = ROWS - 1 if ROWS > 1 else 1
        heavy = M // N_GROUP * HP
        k = (r - heavy) % OTHERS  # the k-th other row of a group is row k + k // (ROWS - 1) + 1 of it
        b = tl.where(r < heavy, r // HP * N_GROUP + r % HP * ROWS, (r - heavy) // OTHERS * N_GROUP + k + k // RL + 1)
    return b


@triton.jit
def _attn_partial_kernel(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, pad_ptr, done_ptr, counters_ptr, shared_ptr, m_ptr,
                         l_ptr, acc_ptr, sm_scale, S, Hkv, STRIDE, G: tl.constexpr, G_PAD: tl.constexpr,
                         D: tl.constexpr, BLOCK_N: tl.constexpr, N_GROUP: tl.constexpr, ROWS: tl.constexpr,
                         Q_PAD: tl.constexpr, PREC: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr):
    """Program (chunk c of C, row b · kv head h): online softmax of the G query heads of h over chunk c of
    the row's own cache columns [start, col] (start = max(pad_b, shared), C chunks of whole blocks of
    BLOCK_N, as even as that allows: they follow the current column, so every program has work from
    the first step to the last); writes its partial max, sum and weighted values to slot c of each
    query head. Columns past the current one are never read; a finished row reads none of its own
    columns (its chunk is empty), but a program that reads a shared prompt (below) reads it whether or
    not the rows it serves have finished.

    The N_GROUP rows of a group (the samples of one prompt; N_GROUP = 1: no groups) hold the same prompt
    in columns [pad, shared). Those are read from the group's first row, once for every ROWS rows: the
    program of every ROWS-th row of a group also takes slice c of them for the query heads of h of that
    row and the ROWS - 1 after it (Q_PAD >= ROWS·G query rows, a larger tile), into slot C + c. Those
    programs launch first (_attn_row); each program's work does not depend on its place."""
    split = tl.program_id(0)
    h = tl.program_id(1) % Hkv
    b = _attn_row(tl.program_id(1) // Hkv, tl.num_programs(1) // Hkv, N_GROUP, ROWS)
    pdl_wait(PDL)
    shared = tl.load(shared_ptr)
    if N_GROUP > 1:
        if (b % N_GROUP) % ROWS == 0:
            first = b - b % N_GROUP
            pad = tl.load(pad_ptr + first)
            lo, hi = _attn_chunk(pad, shared, split, BLOCK_N)
            j = tl.arange(0, Q_PAD)
            i = j // G  # (row b + i, query head h·G + j % G)
            qrow = (b + i) * (Hkv * G) + h * G + j % G
            ok = (j < ROWS * G) & (b % N_GROUP + i < N_GROUP)
            _attn_part(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, m_ptr, l_ptr, acc_ptr, qrow, ok,
                       (first * Hkv + h).to(tl.int64) * S * D, lo, hi, qrow * STRIDE + tl.num_programs(0) + split,
                       sm_scale, Q_PAD, D, BLOCK_N, PREC, FP8)
    lo, hi = _attn_chunk(tl.maximum(tl.load(pad_ptr + b), shared), tl.load(counters_ptr) + 1, split, BLOCK_N)
    hi = tl.where(tl.load(done_ptr + b) != 0, lo, hi)
    g = tl.arange(0, G_PAD)
    qrow = b * (Hkv * G) + h * G + g  # (G_PAD,) rows of q (M·Hq, D)
    _attn_part(q_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, m_ptr, l_ptr, acc_ptr, qrow, g < G,
               (b * Hkv + h).to(tl.int64) * S * D, lo, hi, qrow * STRIDE + split, sm_scale, G_PAD, D, BLOCK_N, PREC,
               FP8)


@triton.jit
def _attn_combine_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, NSPLIT, STRIDE, NS_PAD: tl.constexpr, D: tl.constexpr,
                         HEADS: tl.constexpr, K_STEP: tl.constexpr, PDL: tl.constexpr):
    """Program p: HEADS (row, q head) pairs p·HEADS … of the flattened (rows, Hq): merge the partial
    softmaxes of each one's first NSPLIT slots into the attention output (HEADS·D columns of a row, stored
    in the o GEMM's K order if K_STEP)."""
    row = tl.program_id(0) * HEADS + tl.arange(0, HEADS)
    pdl_launch_next(PDL)  # the o GEMM may start loading its weights
    pdl_wait(PDL)
    s = tl.arange(0, NS_PAD)
    sm = s[None, :] < NSPLIT
    d = tl.arange(0, D)
    slot = row[:, None] * STRIDE + s[None, :]  # (HEADS, NS_PAD)
    m = tl.load(m_ptr + slot, mask=sm, other=float("-inf"))
    mx = tl.max(m, 1)
    w = tl.where(m > float("-inf"), tl.exp(m - mx[:, None]), 0.0)  # empty chunks (and finished rows) weigh 0
    den = tl.sum(tl.load(l_ptr + slot, mask=sm, other=0.0) * w, 1)
    full = sm & (m > float("-inf"))  # (an empty slot's values were not written)
    acc = tl.load(acc_ptr + slot[:, :, None] * D + d[None, None, :], mask=full[:, :, None], other=0.0)
    o = tl.sum(acc * w[:, :, None], 1) / tl.maximum(den, 1e-30)[:, None]  # (HEADS, D)
    o = tl.reshape(o.to(out_ptr.dtype.element_ty), (1, HEADS * D))
    if K_STEP:  # (HEADS·D a multiple of K_STEP)
        o = k_ordered_tile(o, 1, HEADS * D, K_STEP)
    tl.store(out_ptr + tl.program_id(0) * HEADS * D + tl.arange(0, HEADS * D)[None, :], o)


@triton.jit
def _silu_mul_kernel(gu_ptr, a_ptr, b_ptr, out_ptr, M, I, A_STRIDE, R: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, HAS_LORA: tl.constexpr, PREC: tl.constexpr, K_STEP: tl.constexpr,
                     PDL: tl.constexpr):
    """Tile (rows, cols) of silu(gate) * up, with gate|up = the fused GEMM's output + LoRA B products (stored
    in the down GEMM's K order if K_STEP)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rm = rows < M
    cm = cols < I
    mk = rm[:, None] & cm[None, :]
    r = tl.arange(0, R)
    pdl_launch_next(PDL)  # the down GEMM may start loading its weights
    if HAS_LORA:  # the B's (R, BN): no kernel of the step writes them, so before the wait
        bg = tl.load(b_ptr + cols[None, :] * R + r[:, None], mask=cm[None, :], other=0.0)
        bu = tl.load(b_ptr + (I + cols)[None, :] * R + r[:, None], mask=cm[None, :], other=0.0)
    pdl_wait(PDL)
    g = tl.load(gu_ptr + rows[:, None] * (2 * I) + cols[None, :], mask=mk, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + rows[:, None] * (2 * I) + I + cols[None, :], mask=mk, other=0.0).to(tl.float32)
    if HAS_LORA:
        ag = tl.load(a_ptr + rows[:, None] * A_STRIDE + r[None, :], mask=rm[:, None], other=0.0)  # (BM, R)
        au = tl.load(a_ptr + rows[:, None] * A_STRIDE + R + r[None, :], mask=rm[:, None], other=0.0)
        g += tl.dot(ag, bg, input_precision=PREC)
        u += tl.dot(au, bu, input_precision=PREC)
    dt = out_ptr.dtype.element_ty
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)  # F.silu in the model dtype, then the product
    out = (act * u).to(dt)
    if K_STEP:  # (BN a multiple of K_STEP)
        out = k_ordered_tile(out, BM, BN, K_STEP)
    tl.store(out_ptr + rows[:, None] * I + cols[None, :], out, mask=mk)


@triton.jit
def _lora_b_kernel(y_ptr, a_ptr, b_ptr, M, N, A_STRIDE, R: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   PREC: tl.constexpr, PDL: tl.constexpr):
    """Tile (rows, cols) of y += a @ B^T in place, in fp32 and rounded once to y's dtype (as addmm): the
    LoRA B product of a single-linear group (o, down)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    rm = rows < M
    cm = cols < N
    mk = rm[:, None] & cm[None, :]
    r = tl.arange(0, R)
    pdl_launch_next(PDL)  # add_rmsnorm, which follows, may start loading its weight
    b = tl.load(b_ptr + cols[None, :] * R + r[:, None], mask=cm[None, :], other=0.0)  # (R, BN), before the wait
    pdl_wait(PDL)
    a = tl.load(a_ptr + rows[:, None] * A_STRIDE + r[None, :], mask=rm[:, None], other=0.0)  # (BM, R)
    y = tl.load(y_ptr + rows[:, None] * N + cols[None, :], mask=mk, other=0.0).to(tl.float32)
    y += tl.dot(a, b, input_precision=PREC)
    tl.store(y_ptr + rows[:, None] * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mk)


@triton.jit
def _mix32_tl(x):
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _sample_partial_kernel(logits_ptr, V, inv_t, thr_ptr, rowkey_ptr, counters_ptr, pm_ptr, ps_ptr, pbest_ptr,
                           pidx_ptr, NSPLIT, CHUNK: tl.constexpr, BLOCK: tl.constexpr, GREEDY: tl.constexpr,
                           TRUNC: tl.constexpr, PDL: tl.constexpr):
    """Program (row b, vocab chunk): running max and sum of exp(z) over the chunk (for logsumexp) and
    the chunk's best candidate, argmax of z + Gumbel noise (of z when greedy) over the kept tokens."""
    b = tl.program_id(0)
    sp = tl.program_id(1)
    pdl_wait(PDL)
    step = tl.load(counters_ptr + 1)
    ka = _mix32_tl(((tl.load(rowkey_ptr + b) + step) & 0xFFFFFFFF).to(tl.uint32))
    kb = _mix32_tl(ka ^ 0x68E31DA4)
    if TRUNC:
        thr = tl.load(thr_ptr + b)
    m = tl.full([], float("-inf"), tl.float32)
    ssum = tl.zeros([], tl.float32)
    best = tl.full([], float("-inf"), tl.float32)
    best_i = tl.zeros([], tl.int32)
    for off in range(0, CHUNK, BLOCK):
        idx = sp * CHUNK + off + tl.arange(0, BLOCK)
        vm = idx < V
        z = tl.load(logits_ptr + b.to(tl.int64) * V + idx, mask=vm, other=float("-inf")).to(tl.float32) * inv_t
        m_new = tl.maximum(m, tl.max(z, 0))
        safe = m_new > float("-inf")
        ssum = tl.where(safe, ssum * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), 0), 0.0)
        m = m_new
        cand = z
        if not GREEDY:
            hsh = _mix32_tl(_mix32_tl(idx.to(tl.uint32) + ka) ^ kb)
            u = ((hsh >> 8).to(tl.float32) + 0.5) * 5.9604644775390625e-08  # 2^-24
            cand = z - tl.log(-tl.log(u))
            if TRUNC:
                cand = tl.where(z >= thr, cand, float("-inf"))
        cand = tl.where(vm, cand, float("-inf"))
        cb = tl.max(cand, 0)
        ci = tl.argmax(cand, 0, tie_break_left=True).to(tl.int32) + sp * CHUNK + off
        better = cb > best
        best_i = tl.where(better, ci, best_i)
        best = tl.where(better, cb, best)
    o = b * NSPLIT + sp
    tl.store(pm_ptr + o, m)
    tl.store(ps_ptr + o, ssum)
    tl.store(pbest_ptr + o, best)
    tl.store(pidx_ptr + o, best_i)


@triton.jit
def _sample_final_kernel(logits_ptr, V, inv_t, pm_ptr, ps_ptr, pbest_ptr, pidx_ptr, NSPLIT, counters_ptr,
                         done_ptr, stopped_ptr, lengths_ptr, stops_ptr, pad_id, tok_ptr, out_tok_ptr, out_lp_ptr,
                         OUT_STRIDE, NS_PAD: tl.constexpr, NSTOP: tl.constexpr, PDL: tl.constexpr):
    """Program (row b): merge the chunks (token = best candidate, logprob = z[token] − logsumexp),
    then the row's bookkeeping: output slot `step`, next input token, stop / done flags, length."""
    b = tl.program_id(0)
    pdl_wait(PDL)
    s = tl.arange(0, NS_PAD)
    sm = s < NSPLIT
    m = tl.load(pm_ptr + b * NSPLIT + s, mask=sm, other=float("-inf"))
    mx = tl.max(m, 0)
    tot = tl.sum(tl.where(m > float("-inf"), tl.load(ps_ptr + b * NSPLIT + s, mask=sm, other=0.0) * tl.exp(m - mx), 0.0), 0)
    lse = mx + tl.log(tot)
    best = tl.load(pbest_ptr + b * NSPLIT + s, mask=sm, other=float("-inf"))
    jb = tl.argmax(best, 0, tie_break_left=True)
    tok = tl.sum(tl.where(s == jb, tl.load(pidx_ptr + b * NSPLIT + s, mask=sm, other=0), 0), 0).to(tl.int64)
    lp = tl.load(logits_ptr + b.to(tl.int64) * V + tok).to(tl.float32) * inv_t - lse
    step = tl.load(counters_ptr + 1)
    done = tl.load(done_ptr + b)
    stops = tl.load(stops_ptr + tl.arange(0, NSTOP))
    hit = tl.sum((stops == tok).to(tl.int32), 0) > 0
    tok = tl.where(done != 0, pad_id, tok)
    lp = tl.where(done != 0, 0.0, lp)
    tl.store(out_tok_ptr + b * OUT_STRIDE + step, tok)
    tl.store(out_lp_ptr + b * OUT_STRIDE + step, lp)
    tl.store(tok_ptr + b, tok)
    new_stop = hit & (done == 0)
    tl.store(stopped_ptr + b, tl.where(new_stop, 1, tl.load(stopped_ptr + b)))
    tl.store(lengths_ptr + b, tl.where(done != 0, tl.load(lengths_ptr + b), step + 1))
    tl.store(done_ptr + b, tl.where(new_stop, 1, done))

