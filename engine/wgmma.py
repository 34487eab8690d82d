"""The Hopper wgmma kernels (Gluon): plain, warp-specialized, persistent and stream-K.

Speeds up: fp4_gemm.fp4_linear at 2-256 rows of x on Hopper (and gate/up-like layers up to 2048 rows,
down-like ones up to 512), where the mma kernel re-reads x in every warp and Triton's tl.dot would send
the decoded weights through shared memory. Here x sits in shared memory once per program as wgmma's
right operand and the decoded weights are its left operand straight from registers; a producer warp
feeds a ring of shared-memory stages by TMA (warp-specialized), one program an SM walks the tiles
(persistent), and the last waves' k-steps are shared out evenly (stream-K). The launches and the
choice among them are in engine/plan.py.
Tested against: fp4_gemm's torch reference in float64 on a Hopper GPU; on CPU (Gluon has no
interpreter) its PTX runs on engine/ptx.py's emulator, its K order is checked, and both kernels are compiled
for sm_90a by Triton's compiler at the plan's shapes (tests/engine/test_wgmma.py).
Measurements: results/fp4_gemm_h200.md.
"""
import triton

from engine.ptx import _wgmma_word_asm

try:  # Gluon: Triton with explicit layouts. Its API still moves between releases: the kernel ran with
    # triton 3.6 and compiles with 3.8; older ones use the other kernels.
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                   warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAS_GLUON = tuple(int(v) for v in triton.__version__.split(".")[:2]) >= (3, 6)
except ImportError:  # the other kernels serve every shape
    HAS_GLUON = False


# ---- the wgmma kernel (2 to 256 rows of x; Hopper; written in Gluon) ----
#
# The mma kernel (engine/mma.py) keeps x in each warp's registers, so from 16 rows of x on every warp re-reads all
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
# the whole step's (fewer registers held). Split-K as the mma kernel's: fp32 partials and a ticket, the
# last program of a tile sums them in order.
if HAS_GLUON:
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
# often, and more MMAs and decodes are in flight an SM. Each consumer stores its own result
# (_wgmma_epilogue). TMA needs k-steps of 256 (a row's scales: 16 bytes).
# PERSIST: one program an SM walks many tiles (_ws_tile's order) with one ring, so that the loads of a
# tile's first k-steps overlap the consumers' stores of the tile before (where a program's k-steps are
# few, its fill and its stores are what the time goes to).
# STREAM (stream-K, with PERSIST): the last one or two waves of tiles are not dealt out whole, which
# leaves SMs idle when the tiles do not divide evenly among them (down's 56 tiles at 256 rows on 132
# SMs), but as k-steps: every program takes the same run of them, tile after tile (_stream_k), so
# a tile may be shared by a few programs, which sum their fp32 partials as split K does (the last to
# finish adds them up in order; no program waits on another).
# Which variant serves which shape, and what each gained: engine/plan.py, results/fp4_gemm_h200.md.
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
        # variable ("cannot convert JITFunction to tensor", triton 3.6), nor the args alone (their
        # constexprs stop being constexpr, triton 3.8), so no list can reuse another's entries.
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


def ws_descriptors(x, words, scale_u8, bt):
    """The TMA descriptors _wgmma_ws_kernel reads through: x (in wgmma_k_order) in tiles of (bt, 64), the
    codes as 32-bit words in tiles of (64, 32), both 128-byte swizzled, and the scale bytes in tiles of
    (64, 16), unswizzled. (Gluon only: call where HAS_GLUON.)"""
    swizzled = lambda bits: gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=bits, rank=2)
    return (TensorDescriptor.from_tensor(x, [bt, 64], swizzled(16)),
            TensorDescriptor.from_tensor(words, [64, 32], swizzled(32)),
            TensorDescriptor.from_tensor(scale_u8, [64, 16], gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                                                  element_bitwidth=8, rank=2)))
