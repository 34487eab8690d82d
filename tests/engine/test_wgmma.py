"""engine/wgmma.py: the Gluon wgmma kernels (plain, warp-specialized, persistent, stream-K) against
fp4_gemm's float64 reference on a Hopper GPU; on the CPU (Gluon has no interpreter) their PTX decode on
engine/ptx.py's emulator, the K order x must follow, and each kernel compiled for sm_90a by Triton's own
compiler without a GPU (it lowers, and its PTX holds the instructions the design relies on).
"""
import numpy as np
import pytest
import torch
import triton

from engine import korder, ptx
from engine import plan as engine_plan
from engine import wgmma
from engine.plan import _ws_consumer_regs, _ws_maxnreg
from engine.ptx import _halves, _pack, run_ptx_warp
from fp4_ref import DEV, E2M1_SIGNED, assert_replays_in_a_graph, make_q, ref_weight, rel_err

hopper_gluon = pytest.mark.skipif(
    not (wgmma.HAS_GLUON and DEV.type == "cuda" and torch.cuda.get_device_capability() == (9, 0)),
    reason="needs triton with Gluon and a Hopper GPU (sm_90)")

try:  # Triton's compiler driven by hand, for a GPU this machine need not have
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import mangle_type  # (an argument's type, as a launch would specialize it)
except ImportError:
    GluonASTSource = None
offline_gluon = pytest.mark.skipif(not wgmma.HAS_GLUON or GluonASTSource is None,
                                   reason="needs triton with Gluon and its compiler's source API")


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
        y = engine_plan.linear(x, *args, plan)
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + (b.double().cpu() if bias else 0)
        assert torch.isfinite(y).all(), (M, K, N)
        assert rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3), (M, K, N, rel_err(y, ref))
        assert torch.equal(engine_plan.linear(x, *args, plan), y)
    assert engine_plan.plan_forward(24, 37888, 3584, torch.bfloat16, DEV)["kernel"] == "wgmma"
    assert_replays_in_a_graph(lambda x: engine_plan.linear(x, *args, plan), x)


@hopper_gluon
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_wgmma_ws_against_float64(dtype, poisoned):
    """The warp-specialized wgmma kernel (a producer warp filling a ring by TMA; STAGES in the plan)
    against float64: 8-row tiles from one row of x, rings of 2 to 6 stages, shallower and deeper than the
    k-steps, uneven split-K, two or three consumer warpgroups (three: 192 weight rows a tile) with rows past N, bias,
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
            (70, 1536, 600, 128, 2, 2, 3, True, False), (64, 3584, 600, 64, 2, 3, 3, False, True)):
        q = make_q(N, K, per_row, seed=M + K)
        x = torch.randn(M, K, dtype=dtype, device=DEV)
        b = torch.randn(N, dtype=dtype, device=DEV) if bias else None
        args = (q.packed, q.scale.view(torch.uint8), q.global_scale, b)
        tiles = dict(kernel="wgmma", BT=bt, BLOCK_K=256, SPLIT_K=split)
        plan = dict(tiles, STAGES=stages, NWG=nwg)
        y = engine_plan.linear(x, *args, plan)
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + (b.double().cpu() if bias else 0)
        assert torch.isfinite(y).all(), (M, K, N)
        assert rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3), (M, K, N, rel_err(y, ref))
        assert torch.equal(engine_plan.linear(x, *args, plan), y)
        if bt >= 16:
            assert torch.equal(engine_plan.linear(x, *args, tiles), y), (M, K, N)
        assert not engine_plan._locks(x.device).any()
    # codes at an odd offset: not TMA-aligned, so the same tiles without the producer
    wide = make_q(N, K + 256, per_row, seed=3)
    packed, scale = wide.packed[:, 8:8 + K // 2], wide.scale.view(torch.uint8)[:, 1:1 + K // 16]
    assert not engine_plan._tma_fits(packed, scale)
    got = engine_plan.linear(x, packed, scale, wide.global_scale, None, plan)
    assert torch.equal(got, engine_plan.linear(x, packed, scale, wide.global_scale, None, tiles))
    assert_replays_in_a_graph(lambda x: engine_plan.linear(x, *args, plan), x)
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
        y = engine_plan.linear(x, *args, dict(plan, WHOLE=whole))
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + (b.double().cpu() if bias else 0)
        assert rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3), (M, K, N, rel_err(y, ref))
        r = 64 * nwg * whole
        assert torch.equal(y[:, :r], engine_plan.linear(x, *args, dict(plan, SPLIT_K=1))[:, :r])
        assert torch.equal(y[:, r:], engine_plan.linear(x, *args, plan)[:, r:])
        assert not engine_plan._locks(x.device).any()
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
        y = engine_plan.linear(x, *args, dict(plan, PERSIST=True, GROUP_M=group))
        assert torch.isfinite(y).all() and rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3)
        assert torch.equal(y, engine_plan.linear(x, *args, plan)), group
    assert engine_plan.plan_forward(1024, 37888, 3584, dtype, x.device).get("PERSIST")  # gate/up's plan there
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
        _, per, slots = engine_plan._stream_k(tiles, K // 256, engine_plan._ws_places(stream, x.device))
        assert slots > 1 and per % (K // 256) != 0, (M, K, N, per)  # (some tiles shared, as meant)
        y = engine_plan.linear(x, *args, stream)
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()
        assert torch.isfinite(y).all() and rel_err(y, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3), (M, K, N)
        assert torch.equal(engine_plan.linear(x, *args, stream), y)
        assert not engine_plan._locks(x.device).any()



@pytest.mark.skipif(not wgmma.HAS_GLUON, reason="needs triton with Gluon")
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
            regs = run_ptx_warp(ptx._wgmma_word_asm(f16), {"$4": word, "$12": _pack(sv, sv, ty)})
            for r in range(4):
                for h, v in enumerate(_halves(regs[f"${r}"], ty)):
                    e = 2 * r + h
                    a, b = e // 4, (e // 2) % 2
                    a_mat[g, s * bk + 16 * (2 * j + a) + 8 * b + 2 * t + (e % 2)] = v
    x = rng.standard_normal((5, K))
    order = korder.wgmma_k_order(K, bk, torch.device("cpu")).numpy()
    assert sorted(order) == list(range(K))
    np.testing.assert_allclose(a_mat @ x[:, order].T * 256, w @ x.T, rtol=1e-12, atol=1e-12)


def compile_for_hopper(kernel, types, constexprs, **options):
    """`kernel` (a Gluon or a Triton kernel) compiled for sm_90a on this machine (Triton's compiler and the ptxas
    it ships; no GPU needed). types: {argument: Triton type} for the runtime arguments, constexprs: {argument:
    value}; pointers and strides are taken 16-byte aligned, as engine/plan.py's launches on aligned tensors
    specialize them.
    Returns the compiled kernel (its asm["ptx"], asm["cubin"])."""
    names = kernel.arg_names
    signature = {n: types.get(n, "constexpr") for n in names}
    aligned = [i for i, n in enumerate(names) if signature[n].startswith("*") or n.startswith("stride")]
    Source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    source = Source(kernel, signature, constexprs, attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, **options))


def assert_wgmma_ptx(compiled, bt, f16, tickets):
    """What every wgmma kernel's PTX must hold: the m64 x bt x k16 MMA on 16-bit operands with fp32 sums, the
    wait for the kernel before (programmatic dependent launch), and the ticket of the split-K sum where a
    tile's k-steps are shared (`tickets`: split K, or stream-K); and ptxas made a cubin of it."""
    ty = "f16" if f16 else "bf16"
    ptx_text = compiled.asm["ptx"]
    assert f"wgmma.mma_async.sync.aligned.m64n{bt}k16.f32.{ty}.{ty}" in ptx_text
    assert "griddepcontrol.wait" in ptx_text and len(compiled.asm["cubin"]) > 0
    assert ("atom.global" in ptx_text) == tickets


@offline_gluon
@pytest.mark.parametrize("bt,bk,split,f16", [(16, 256, 8, False), (32, 256, 3, True), (64, 128, 4, False),
                                             (128, 128, 1, False)])
def test_plain_kernel_compiles_for_hopper(bt, bk, split, f16):
    """_wgmma_kernel at the plan's tiles of x (16 to 128 rows), k-steps of 128 and 256, split or not, bf16 or
    f16, compiled for sm_90a without a GPU: Gluon has no interpreter, so this is the CPU's check that the
    kernel lowers (its layouts convert as they assert, its shapes agree) with the Triton installed. Its
    PTX: the MMA of the tile's width, x copied to shared memory asynchronously (cp.async), and no TMA."""
    x = "*fp16" if f16 else "*bf16"
    types = dict(x_ptr=x, wp_ptr="*u8", ws_ptr="*u8", gs_ptr="*fp32", bias_ptr=x, y_ptr=x, part_ptr="*fp32",
                 lock_ptr="*i32", **{n: "i32" for n in ("M", "N", "n_steps", "stride_xm", "stride_ym", "stride_wn",
                                                       "stride_sn", "split_steps")})
    k = compile_for_hopper(wgmma._wgmma_kernel, types, dict(BT=bt, BK=bk, SPLIT_K=split, GS_PER_ROW=True,
                                                            HAS_BIAS=True, F16=f16, PDL=True))
    assert_wgmma_ptx(k, bt, f16, split > 1)
    assert "cp.async.cg.shared.global" in k.asm["ptx"] and "cp.async.bulk.tensor" not in k.asm["ptx"]


@offline_gluon
@pytest.mark.parametrize("bt,stages,nwg,split,whole,persist,stream", [
    (8, 4, 1, 4, False, False, False), (16, 2, 2, 2, True, False, False), (32, 2, 3, 2, True, False, False),
    (64, 2, 1, 3, False, False, False), (64, 3, 3, 2, True, False, False), (128, 2, 3, 1, False, True, True),
    (128, 2, 2, 1, False, True, False)])
def test_warp_specialized_kernel_compiles_for_hopper(bt, stages, nwg, split, whole, persist, stream):
    """_wgmma_ws_kernel in the plan's shapes and the sweep's (one to three consumer warpgroups, rings of 2 to 4, split,
    WHOLE, persistent, stream-K), compiled for sm_90a without a GPU with the launch's registers
    (_ws_maxnreg, _ws_consumer_regs): the producer's TMA copies and the ring's barriers are in its PTX, and
    the partitions trade registers (setmaxnreg)."""
    x = torch.zeros(max(bt, 64), 512, dtype=torch.bfloat16)  # descriptors: only their types are compiled in
    words, scale = torch.zeros(192, 64, dtype=torch.int32), torch.zeros(192, 32, dtype=torch.uint8)
    descs = dict(zip(("x_desc", "w_desc", "s_desc"), map(mangle_type, wgmma.ws_descriptors(x, words, scale, bt))))
    types = dict(descs, gs_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32",
                 **{n: "i32" for n in ("M", "N", "n_steps", "stride_ym", "split_steps", "tiles_n", "whole", "m_tiles",
                                       "group_m", "stream_from", "sk_per")})
    k = compile_for_hopper(wgmma._wgmma_ws_kernel, types,
                           dict(BT=bt, STAGES=stages, NWG=nwg, SPLIT_K=split, WHOLE=whole, PERSIST=persist,
                                STREAM=stream, GS_PER_ROW=True, HAS_BIAS=False, F16=False, PDL=True,
                                CONSUMER_REGS=_ws_consumer_regs(nwg)), maxnreg=_ws_maxnreg(nwg))
    assert_wgmma_ptx(k, bt, False, split > 1 or stream)
    for instruction in ("cp.async.bulk.tensor", "mbarrier.try_wait", "setmaxnreg"):
        assert instruction in k.asm["ptx"], instruction
