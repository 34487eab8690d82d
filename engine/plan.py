"""The plan: which kernel serves which shape, with which launch config, and the launches themselves.

Speeds up: fp4_gemm.fp4_linear and its dX on a GPU. fp4_gemm.py's one dispatch point hands every CUDA
tensor (and every kernel pinned with fp4_gemm.set_backend(kernel=...)) to `linear` / `dx` here, which
pick a kernel per shape from a small fixed table (`plan_forward`, `plan_dx`: nothing tuned at run time,
so CUDA graphs and torch.compile see fixed configs) and launch it: the mma / GEMV kernels
(engine/mma.py), the wgmma kernels (engine/wgmma.py), fp4_gemm's tiled kernel with the PTX decode
(engine/ptx.py), or dequant + cuBLAS (this file: one layer's weight written in x's dtype, bit-identical
to nvfp4.dequantize, cuBLAS multiplies, the copy dies at once).
Tested against: fp4_gemm's torch reference in float64, each kernel pinned, under the interpreter on CPU
and compiled on a GPU (tests/engine/test_plan.py and the kernel files' tests).
The table was read off `python -m engine.bench_gemm --bench/--tune` on an H200: results/fp4_gemm_h200.md.
"""
import functools

import torch
import triton
import triton.language as tl

import fp4_gemm
from engine import ptx
from engine.fp8 import round_e4m3
from engine import wgmma as wgmma_kernels
from engine.mma import _gemv_kernel, _mma_kernel
from engine.korder import _k_step_of, _x_rows, k_ordered
from engine.pdl import capability, pdl_opts
from fp4_backend import k_chunk, launch_opts, launchable, pinned_kernel, split_k
from fp4_gemm import decode_plain, e2m1_to_f32, e4m3_to_f32


# ---------------------------------------------------------------------------------------------
# Per-shape configs (measured on an H200 with --tune; see results/fp4_gemm_h200.md)
# ---------------------------------------------------------------------------------------------

def plan_forward(M, N, K, dtype, device, mma=True):
    """The kernel and its launch config for y (M, N) = x (M, K) @ W^T: a small table read off
    `python -m engine.bench_gemm --bench/--tune` on an H200 (Qwen2.5-7B shapes; results/fp4_gemm_h200.md
    holds the measurements behind each choice and the variants tried). Fixed
    per shape, so nothing is tuned at run time (CUDA-graph and torch.compile safe). Returns a dict
    whose "kernel" is "mma", "gemv", "wgmma", "tiled" or "dequant". mma=False: a plan without the mma
    and wgmma kernels (for packed codes they cannot read as aligned words)."""
    kernel = pinned_kernel()
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
            kernel = "mma"  # decode: tensor cores on one row; on Hopper wgmma is faster from 2 rows
        elif M == 1:
            kernel = "gemv"  # fp32 x
        elif wgmma and (M <= 256 or (K % 256 == 0 and ((M <= 2048 and N >= 16384) or (M <= 512 and K >= 8192)))):
            kernel = "wgmma"  # and gate/up-like (wide) layers up to 2048 rows, down-like (long-K) ones up to 512
            # (stream-K, below)
        elif M > 128 or dtype == torch.float32:
            kernel = "dequant"  # compute dominates: this layer's bf16 weight + cuBLAS (fp32: exact fp32 GEMM)
        else:
            kernel = "tiled"
    if kernel == "dequant":
        return dict(kernel="dequant", DQ=(16, 256, 4))
    if kernel == "mma":  # 64 weight rows a program, 128 (two row tiles a warp, sharing each lane's x) for
        # gate/up from 2 rows of x and for q/k/v and down from 5; split K (up to 8 ways, 16 for down's long
        # K) until there are ~2000 programs at M = 1, ~500 a row tile above
        rt = 2 if (M > 1 and N >= 16384) or (M > 4 and (N > 4096 or K >= 8192)) else 1
        cap = 16 if K >= 8192 else 8
        split = 1
        while split < cap and triton.cdiv(N, 64 * rt) * split < (2000 if M == 1 else 500 * rt):
            split *= 2
        return dict(kernel="mma", ROW_TILES=rt, num_warps=4, SPLIT_K=split)
    if kernel == "wgmma":  # 64 weight rows x 16, 32, 64 or 128 rows of x a program (128 for the wide or
        # long layers above 64 rows), k-steps of 256 or 128; K split to give the narrow layers more programs:
        # 8 ways below 64 rows of x, 4 at 64 rows, 2 above; gate/up has programs enough unsplit
        bt = _wgmma_rows_of_x(M, N, K)
        # persistent programs (one an SM) over tiles of 128 rows of x in groups of 16, so that the ring loads
        # the next tile while the consumers store the last, with the last one or two waves' k-steps shared out
        # evenly (stream-K): gate/up-like layers at 129-2048 rows, down-like ones at 257-512, both with three
        # consumer warpgroups (192 weight rows: more decodes and MMAs in flight an SM than two)
        stream = dict(kernel="wgmma", BT=128, BLOCK_K=256, SPLIT_K=1, STAGES=2, NWG=3, PERSIST=True, STREAM=True,
                      GROUP_M=16)
        if K % 256 == 0 and (M > 256 or (M > 128 and N >= 16384)):
            return stream
        if K % 256 == 0 and (M > 32 or (M > 16 and N >= 16384)):  # warp-specialized, a 2-deep ring; at 32 rows
            # or fewer the plain kernel's own prefetch keeps up, but for gate/up-like layers on three warpgroups
            if N >= 16384:  # gate/up-like: programs enough unsplit but for the last wave (below)
                split = 1
            elif K >= 8192:  # down-like: few weight tiles and a long K, split deeper at fewer rows of x
                split = 4 if M <= 128 else 2
            elif M <= 64:  # q/k/v and o at one tile of x: split in two for programs enough
                split = 2
            else:  # q/k/v and o at two or more tiles of x: programs enough unsplit, as gate/up
                split = 1
            # gate/up-like layers: three consumer warpgroups (192 weight rows a program), unsplit but for the
            # last wave. The others: two (128 weight rows) under 128-row tiles of x, except for o_proj's
            # 3584 x 3584 at 256 rows (one)
            nwg = 3 if N >= 16384 else 2 if bt == 128 and (N > 4096 or K >= 8192) else 1
            plan = dict(kernel="wgmma", BT=bt, BLOCK_K=256, SPLIT_K=split, STAGES=2, NWG=nwg)
            tiles, places = triton.cdiv(N, 64 * nwg) * triton.cdiv(M, bt), _ws_places(plan, device)
            if split > 1 and K >= 8192 and tiles * split > places:  # down-like layers whose
                # splits would spill past one wave (14B and 32B down): as many splits as fit in it, or stream-K
                # where that is one
                split = places // tiles
                if split < 2:  # (two consumer warpgroups here: three measured slower)
                    return dict(stream, NWG=2)
                plan["SPLIT_K"] = split
            if split == 2 and N > K and 3 * tiles <= places:  # q/k/v when 3 splits of its tiles fill at most
                # one wave (o, N = K, lost with 3 or 4)
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
    elif M <= 64:  # 32 or 64 rows a tile; few output tiles, so split K deeply
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
    shared out over about one wave of programs. Else nothing. Gate/up at 64 rows of x on three consumer
    warpgroups has 198 tiles on an H200: 132 whole, then 66 split two ways."""
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


def _ws_consumer_regs(nwg):
    """Registers a thread of each consumer warpgroup once the partitions trade them (setmaxnreg): the producer
    warp keeps 24 of its warpgroup's share, the consumers share the rest of (nwg + 1) · _ws_maxnreg evenly, in
    steps of 8."""
    return ((nwg + 1) * _ws_maxnreg(nwg) - 24) // nwg // 8 * 8


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
    return (wgmma_kernels.HAS_GLUON and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16) and K % 128 == 0
            and _is_hopper(device))


def _is_hopper(device):
    return capability(device) == (9, 0)


def plan_dx(M, N, K, dtype, device):
    """Kernel and config for dX (M, K) = dY (M, N) @ W. The training pass has M in the thousands, where
    dequant + cuBLAS measured best (results/fp4_gemm_h200.md); the tiled kernel serves small M."""
    kernel = pinned_kernel()
    if device.type == "cpu":
        if kernel == "dequant":
            return dict(kernel="dequant")
        return dict(kernel="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=2)
    if kernel == "dequant" or (kernel is None and (M > 128 or dtype == torch.float32)):
        return dict(kernel="dequant", DQ=(16, 256, 4))
    bm = 16 if M <= 16 else 64
    return dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3)


# ---------------------------------------------------------------------------------------------
# dequant + cuBLAS
# ---------------------------------------------------------------------------------------------

@triton.jit
def _dequant_kernel(wp_ptr, ws_ptr, gs_ptr, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GS_PER_ROW: tl.constexpr, E4M3: tl.constexpr, TRANSPOSE: tl.constexpr):
    """W (N, K) in out's dtype, with nvfp4.dequantize's float32 arithmetic (so bit-identical to it):
    e2m1 * (scale / g), one rounding to the output dtype (E4M3: engine/fp8.py's, as torch's cast).
    TRANSPOSE: stored as W^T (K, N) instead."""
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
    bs = tl.math.div_rn(e4m3_to_f32(sb), g)  # (BN, BK/16), IEEE division as torch's
    c = tl.reshape(p, (BLOCK_N, BLOCK_K // 16, 8)).to(tl.uint16)
    lo = (e2m1_to_f32(c & 0xF) * 16384.0) * bs[:, :, None]  # (BN, BK/16, 8) even k, exact e2m1 * bs
    hi = (e2m1_to_f32(c >> 4) * 16384.0) * bs[:, :, None]  # odd k
    w = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K))
    if E4M3:
        w = round_e4m3(w)
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    if TRANSPOSE:
        at = out_ptr + offs_k[None, :].to(tl.int64) * N + offs_n[:, None]
    else:
        at = out_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]
    tl.store(at, w.to(out_ptr.dtype.element_ty), mask=mask)


def dequantize_triton(packed, scale_u8, gs, dtype, cfg=None, transpose=False):
    """One weight, (N, K) in `dtype`, bit-identical to dequantize(); what the dequant path multiplies.
    transpose: W^T (K, N), contiguous, written as such (64 x 64 tiles, so that each store is whole rows)."""
    n, k = packed.shape[0], packed.shape[1] * 2
    out = torch.empty((k, n) if transpose else (n, k), dtype=dtype, device=packed.device)
    bn, bk, warps = cfg or ((64, 64, 4) if transpose else (16, 256, 4) if packed.is_cuda else (32, 64, 4))
    launchable(_dequant_kernel, packed.device)[(triton.cdiv(n, bn), triton.cdiv(k, bk))](
        packed, scale_u8, gs, out, n, k, BLOCK_N=bn, BLOCK_K=bk, GS_PER_ROW=gs.numel() > 1,
        E4M3=dtype == torch.float8_e4m3fn, TRANSPOSE=transpose, num_warps=warps)
    return out


# ---------------------------------------------------------------------------------------------
# Launchers (2-D x; uint8 views of the packed codes and the E4M3 scales)
# ---------------------------------------------------------------------------------------------

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


def _small_split(K, bk=256):
    """split_k for small_linear: a range per block of bk, at most 32 ranges (tens of programs share A)."""
    return split_k(K, min(32, triton.cdiv(K, bk)), bk)


def _side_outputs(x2, SR, split):
    """x2 @ side^T's output (M, SR) in x2's dtype and its fp32 split-K partials (split, M, SR), the output
    itself when K is not split."""
    out = torch.empty(x2.shape[0], SR, dtype=x2.dtype, device=x2.device)
    return out, torch.empty(split, x2.shape[0], SR, dtype=torch.float32, device=x2.device) if split > 1 else out


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
        wgmma_kernels._wgmma_kernel[grid](xp, packed, scale_u8, gs, bias, y, part, _locks(x2.device, grid[0] * grid[1]), M, N, steps,
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
    x_desc, w_desc, s_desc = wgmma_kernels.ws_descriptors(xp, packed.view(torch.int32), scale_u8, bt)
    # Registers: _ws_maxnreg a thread for every warpgroup of the program (the producer's counts as one); the
    # partitions then trade them (setmaxnreg, _ws_consumer_regs).
    locks = _locks(x2.device, 0 if part is y else tiles_n * nwg * m_tiles)
    wgmma_kernels._wgmma_ws_kernel[grid](x_desc, w_desc, s_desc, gs, bias, y, part, locks, M, N, steps, y.stride(0), split_steps,
                           tiles_n, whole, m_tiles, plan.get("GROUP_M", m_tiles), stream_from, sk_per, BT=bt,
                           STAGES=plan["STAGES"], NWG=nwg, WHOLE=some_whole, PERSIST=persist,
                           STREAM=stream_from < m_tiles * tiles_n,
                           CONSUMER_REGS=_ws_consumer_regs(nwg), maxnreg=_ws_maxnreg(nwg), **flags)
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


def _tile_decode(x2, plan):
    """fp4_gemm's tiled kernels decode with the PTX block on the GPU (16-bit x); the plan key asm=False
    keeps the plain decode (the tests compare the two)."""
    asm = plan.get("asm", True) and x2.is_cuda and x2.dtype in (torch.bfloat16, torch.float16)
    return ptx.decode_ptx if asm else decode_plain


def linear(x2, packed, scale_u8, gs, bias, plan=None, constant_weight=False, x_k_ordered=False):
    """y (M, N) = x2 (M, K) @ W^T (+ bias) with the plan's kernel; `plan` overrides plan_forward.
    constant_weight: the caller vouches that the kernel just before in the stream does not write the
    weight, so that the mma kernel may load its first codes before its launch wait (see engine/pdl.py).
    x_k_ordered: x2 is stored in the warp-specialized wgmma kernel's K order (engine/korder.py), which the
    plan must then run."""
    M, K = x2.shape
    N = packed.shape[0]
    plan = _runnable_plan(x2, packed, scale_u8, plan)
    if x_k_ordered and not (_k_step_of(plan) and x2.is_contiguous() and x2.data_ptr() % 16 == 0):
        raise ValueError(f"fp4_linear: x in K order needs the warp-specialized wgmma kernel's plan and a contiguous, "
                         f"16-byte aligned x, not {plan} for x {tuple(x2.shape)}")
    if M == 0:
        return torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    if plan["kernel"] == "dequant":
        w = dequantize_triton(packed, scale_u8, gs, x2.dtype, plan.get("DQ"))  # (N, K): this layer's, freed on return
        return torch.nn.functional.linear(x2, w, bias.to(x2.dtype) if bias is not None else None)
    if plan["kernel"] == "wgmma":
        return _wgmma_linear(x2, packed, scale_u8, gs, bias, plan, x_k_ordered)
    if plan["kernel"] == "mma":
        return _mma_linear(x2, packed, scale_u8, gs, bias, plan, constant_weight=constant_weight)
    if plan["kernel"] == "gemv":
        return _gemv_linear(x2, packed, scale_u8, gs, bias, plan)
    return fp4_gemm.tiled_linear(x2, packed, scale_u8, gs, bias, plan, decode=_tile_decode(x2, plan))


def _mma_linear(x2, packed, scale_u8, gs, bias, plan, side=None, constant_weight=False):
    """The mma kernel's launch, which also sums its own split-K partials. side: an optional small (SR, K)
    matrix in x2's dtype whose product x2 @ side^T rides along as extra programs of the same launch
    (engine/side.py); then returns (y, x2 @ side^T)."""
    M, K = x2.shape
    N = packed.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    split, k_split = split_k(K, plan.get("SPLIT_K", 1), 256)  # (the mma kernel's k-step is 256)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x2.device) if split > 1 else y
    nw, rt = plan["num_warps"], plan["ROW_TILES"]
    n_w = triton.cdiv(N, 16 * nw * rt)
    grid = [n_w, triton.cdiv(M, 8), split]
    # The side product's programs follow the weight's along axis 0: its K chunks (as small_linear's,
    # rounded up to a multiple of the weight's split) spread over `cols` columns a tile x the split axis.
    sa, sout, spart, sr, sk, cols, sside = gs, gs, gs, 0, 0, 0, 1
    if side is not None:
        sr, cols = side.shape[0], triton.cdiv(_small_split(K)[0], split)
        sside = cols * split
        sk = k_chunk(K, sside, 256)
        sa, (sout, spart) = side.contiguous(), _side_outputs(x2, sr, sside)
        grid[0] += triton.cdiv(sr, 16) * cols
    launchable(_mma_kernel, x2.device)[tuple(grid)](
        x2, packed, scale_u8, gs, bias if bias is not None else gs, y, part, _locks(x2.device, grid[0] * grid[1]),
        M, N, K, x2.stride(0) // 2, y.stride(0), packed.stride(0) // 4, scale_u8.stride(0), k_split, sa, sout, spart,
        sr, n_w, sk, ROW_TILES=rt, NUM_WARPS=nw, EVEN_K=K % 256 == 0 and k_split % 256 == 0,
        USE_ASM=x2.is_cuda and plan.get("asm", True), F16=x2.dtype == torch.float16, SIDE_COLS=cols,
        SIDE_SPLIT=sside, SIDE_PAD=triton.next_power_of_2(sside), SIDE_F32=not x2.is_cuda, W_EARLY=constant_weight,
        **pdl_opts(x2.device), num_warps=nw, num_stages=plan.get("num_stages", 1), SPLIT_K=split,
        GS_PER_ROW=gs.numel() > 1, HAS_BIAS=bias is not None)
    return (y, sout) if side is not None else y


def _gemv_linear(x2, packed, scale_u8, gs, bias, plan):
    """The fp32 GEMV's launch (one row of x a program), then fp4_gemm's split-K reduce."""
    M, K = x2.shape
    N = packed.shape[0]
    y = torch.empty(M, N, dtype=x2.dtype, device=x2.device)
    bk = plan["BLOCK_K"]
    split, k_split = split_k(K, plan.get("SPLIT_K", 1), bk)
    part = torch.empty(split, M, N, dtype=torch.float32, device=x2.device) if split > 1 else y
    grid = (triton.cdiv(N, plan["BLOCK_N"]), M, split)
    # On the GPU the decode is the PTX on 32-bit words (whatever x's dtype); the interpreter runs the
    # plain Triton decode.
    launchable(_gemv_kernel, x2.device)[grid](
        x2, packed, scale_u8, gs, bias if bias is not None else gs, y, part, M, N, K, x2.stride(0), y.stride(0),
        packed.stride(0), scale_u8.stride(0), k_split, BLOCK_N=plan["BLOCK_N"], BLOCK_K=bk, X16=_pairs_aligned(x2),
        X_IS_BF16=x2.dtype == torch.bfloat16, USE_ASM=plan.get("asm", True) and x2.is_cuda and _words_aligned(packed),
        EVEN_K=k_split * split == K, SPLIT_K=split, GS_PER_ROW=gs.numel() > 1, HAS_BIAS=bias is not None,
        **launch_opts(plan))
    if split > 1:
        fp4_gemm.splitk_reduce(part, gs, bias, y)
    return y


def dx(g2, packed, scale_u8, gs, plan=None):
    """dX (M, K) = g2 (M, N) @ W with the plan's kernel: dequant + cuBLAS, or fp4_gemm's tiled dX kernel."""
    M, N = g2.shape
    K = packed.shape[1] * 2
    plan = plan or plan_dx(M, N, K, g2.dtype, g2.device)
    if plan["kernel"] == "dequant":
        return g2 @ dequantize_triton(packed, scale_u8, gs, g2.dtype, plan.get("DQ"))
    return fp4_gemm.tiled_dx(g2, packed, scale_u8, gs, plan, decode=_tile_decode(g2, plan))
