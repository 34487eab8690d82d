"""engine/plan.py: the per-shape plan, dequant + cuBLAS, the launches, and programmatic dependent launch
(engine/pdl.py), against fp4_gemm's float64 reference and nvfp4.dequantize; and the benchmark's table
(engine/bench_gemm.py).

Two tests here pin the plan's table on an H200 (which kernel and config serves which Qwen2.5 shape):
they are the plan's regression table, and a deliberate change to the table changes them with it.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fp4_gemm
from engine import bench_gemm, pdl
from engine import plan as engine_plan
from fp4_ref import DEV, forward_case, make_q, needs_triton, ref_weight


@needs_triton
@pytest.mark.parametrize("case", range(6))
def test_dequant_forward_against_float64(case, poisoned):
    """fp4_gemm.fp4_linear with dequant + cuBLAS pinned, at odd shapes, bias, per-row global scales."""
    err, limit, what = forward_case("dequant", case)
    assert err <= limit, (what, err)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequant_kernel_is_bit_identical(dtype, poisoned):
    """The dequant path's Triton kernel reproduces nvfp4.dequantize (through fp4_gemm.dequantize), per-tensor
    and per-row scales, bit for bit: same float32 arithmetic, one rounding. (Triton's interpreter rounds
    float32 → bf16 by truncation, so on CPU bf16 may differ by one bf16 step.)"""
    for per_row in (False, True):
        q = make_q(40, 272, per_row, seed=21 + per_row)
        got = engine_plan.dequantize_triton(q.packed, q.scale.view(torch.uint8), q.global_scale, dtype).cpu()
        want = fp4_gemm.dequantize(q.packed, q.scale, q.global_scale, dtype).cpu()
        if dtype == torch.float32 or DEV.type == "cuda":
            assert torch.equal(got, want)
        else:
            assert ((got.float() - want.float()).abs() <= want.float().abs() * 2**-7).all()
        exact = ref_weight(q.packed, q.scale, q.global_scale)  # float32 scale / g is the only rounding
        assert torch.allclose(fp4_gemm.dequantize(q.packed, q.scale, q.global_scale, torch.float64).cpu(), exact,
                              rtol=2**-23, atol=0)



def test_hopper_plans_are_configs_the_sweep_tries(monkeypatch):
    """The plan's regression table. plan_forward's table on an H200 only ever picks configs that `--tune` times (so each was measured
    and is checked by the GPU tests' kernels), for the Qwen2.5 7B, 14B and 32B layer shapes: the
    mma at one row, the plain wgmma kernel from 2 to 32 rows, the warp-specialized one from 33 to 256
    (gate/up from 17, with three consumer warpgroups), with k-steps of 256, and its persistent stream-K
    form for gate/up from 129 to 2048 rows and for down from 257 to 512 (three warpgroups); down's splits
    fit in one wave (14B and 32B: 3, not 4; stream-K with two warpgroups at 129-256 rows); dequant +
    cuBLAS for the rest above 256."""
    monkeypatch.setattr(engine_plan, "_is_hopper", lambda device: True)
    monkeypatch.setattr(engine_plan.wgmma_kernels, "HAS_GLUON", True)
    monkeypatch.setattr(engine_plan, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")  # plan_forward's GPU table; nothing runs on a GPU here
    shapes = [(3584, 4608), (3584, 3584), (3584, 37888), (18944, 3584),  # 7B: K, N of q/k/v, o, gate/up, down
              (5120, 7168), (5120, 5120), (5120, 27648), (13824, 5120),  # 14B
              (5120, 7168), (5120, 5120), (5120, 55296), (27648, 5120)]  # 32B
    for M in (1, 2, 4, 8, 9, 16, 17, 32, 33, 64, 65, 100, 128, 129, 200, 256, 257, 512, 513, 1024, 2048, 2049, 4096):
        for K, N in shapes:
            plan = engine_plan.plan_forward(M, N, K, torch.bfloat16, cuda)
            assert plan in bench_gemm._candidates(M, N, K, "fwd"), (M, N, K, plan)
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
        first, per, slots = engine_plan._stream_k(tiles, n, places)
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
    """Part of the plan's regression table. An unsplit warp-specialized plan with more tiles than one wave of programs keeps the full waves'
    tiles whole and splits the rest about as many ways as one wave has places for them; with fewer
    tiles than a wave, or whole waves, nothing changes. The same wave sets q/k/v's three splits at
    33-64 rows. (132 SMs as an H200; two programs an SM hold 64-row tiles of x with one consumer
    warpgroup, one holds 128-row tiles with two.)"""
    monkeypatch.setattr(engine_plan, "_sm_count", lambda device: 132)
    monkeypatch.setattr(engine_plan, "_is_hopper", lambda device: True)
    monkeypatch.setattr(engine_plan.wgmma_kernels, "HAS_GLUON", True)
    cuda = torch.device("cuda")  # nothing runs on a GPU here
    one = dict(kernel="wgmma", BT=64, BLOCK_K=256, SPLIT_K=1, STAGES=2, NWG=1)
    two = dict(one, BT=128, NWG=2)
    assert engine_plan._ws_programs_per_sm(one) == 2 and engine_plan._ws_programs_per_sm(two) == 1
    # gate/up (37888 rows, K 3584 = 14 k-steps): 592 tiles of 64 = 2 waves of 264 + 64 split 4 ways
    assert engine_plan._last_wave_split(one, 64, 37888, 3584, cuda) == dict(WHOLE=528, SPLIT_K=4)
    # 296 tiles of 128 at 128 rows: 264 + 32 x 4; at 256 rows (two tiles of x) 2 x 264 + 64 x 2
    assert engine_plan._last_wave_split(two, 128, 37888, 3584, cuda) == dict(WHOLE=264, SPLIT_K=4)
    assert engine_plan._last_wave_split(two, 256, 37888, 3584, cuda) == dict(WHOLE=264, SPLIT_K=2)
    # no more splits than k-steps: 2 k-steps, 265 tiles
    assert engine_plan._last_wave_split(one, 64, 265 * 64, 512, cuda) == dict(WHOLE=264, SPLIT_K=2)
    assert engine_plan._last_wave_split(one, 64, 264 * 64, 3584, cuda) == {}  # exactly one wave
    assert engine_plan._last_wave_split(one, 64, 200 * 64, 3584, cuda) == {}  # less than one
    assert engine_plan._last_wave_split(one, 64, 527 * 64, 3584, cuda) == {}  # 263 left: no room to split
    # q/k/v (72 tiles) splits three ways at 33-64 rows, where that fits one wave; o (56 tiles, N = K) two
    for M in (33, 64):
        assert engine_plan.plan_forward(M, 4608, 3584, torch.bfloat16, cuda)["SPLIT_K"] == 3
        assert engine_plan.plan_forward(M, 3584, 3584, torch.bfloat16, cuda)["SPLIT_K"] == 2
    assert engine_plan.plan_forward(64, 7168, 5120, torch.bfloat16, cuda)["SPLIT_K"] == 2  # 14B q/k/v: 112 tiles


def test_bench_table_names_every_planned_kernel(monkeypatch):
    """`python -m engine.bench_gemm --bench` (and `python fp4_gemm.py --bench`) prints one table row per
    problem whatever kernel the per-shape plan
    picked (a missing key in one plan kind once lost a GPU run's table)."""
    monkeypatch.setattr(engine_plan, "_sm_count", lambda device: 132)
    cuda = torch.device("cuda")  # plan_forward's GPU table; nothing runs on a GPU here
    rows = []
    for i, (M, (K, parts, _)) in enumerate([(M, s) for M in bench_gemm.BENCH_M for s in bench_gemm.QWEN7B_SHAPES.values()]):
        N = sum(parts)
        plan = engine_plan.plan_forward(M, N, K, torch.bfloat16, cuda)
        rows.append(dict(shape=f"s{i}", M=M, N=N, K=K, direction="fwd", plan=plan, ms=1e-3 * (i + 1), err=1e-3,
                         cublas_ms=2e-3, cublas_err=2e-3, tbps=1.0, tflops=2.0, ratio=2.0 / (i + 1)))
    rows.append(dict(rows[-1], shape="dx", direction="dx", plan=engine_plan.plan_dx(4096, 3584, 18944, torch.bfloat16, cuda)))
    for M in (1, 64, 4096):  # and every config --tune may report as the best
        rows += [dict(rows[-1], shape="s-tune", M=M, plan=p) for p in bench_gemm._candidates(M, 37888, 3584, "fwd")]
    lines = bench_gemm._table(rows, 4.25, device="a GPU").splitlines()
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


@needs_triton
def test_pdl_launch_options_only_where_they_run(monkeypatch):
    """Programmatic dependent launch needs a Hopper or newer GPU: never on CPU tensors (the interpreter),
    never with QERL_PDL=0 (the choice it sets), and with it the kernels' PDL flag goes with the launch
    option."""
    assert pdl.pdl_opts(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    assert pdl.pdl_opts(torch.device("cuda")) == {"PDL": False}
    if torch.cuda.is_available():
        monkeypatch.setattr(pdl, "ENABLED", True)
        on = torch.cuda.get_device_capability() >= (9, 0) and pdl.HAS_PDL
        assert pdl.pdl_opts(torch.device("cuda")) == ({"PDL": True, "launch_pdl": True} if on else {"PDL": False})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_fp4_gemm_bench_passes_through_to_the_engine():
    """`python fp4_gemm.py --bench` runs engine/bench_gemm.py's CLI (same flags, same table): without a GPU
    both refuse with the same message."""
    root = Path(fp4_gemm.__file__).parent
    for cmd in (["fp4_gemm.py", "--bench"], ["-m", "engine.bench_gemm", "--bench"]):
        r = subprocess.run([sys.executable, *cmd], cwd=root, capture_output=True, text=True)
        assert r.returncode != 0 and "need a CUDA GPU" in r.stderr, r.stderr

