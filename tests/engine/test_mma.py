"""engine/mma.py: the mma.sync tensor-core GEMV and the fp32 GEMV against fp4_gemm's float64 reference.

Under the interpreter (CPU) the mma kernel runs its plain-Triton model of the PTX block; on a GPU the PTX
itself, held to that model. (The PTX block alone runs on the emulator in test_ptx.py.)
"""
import pytest
import torch

from engine import plan as engine_plan
from fp4_ref import DEV, check_split_k, forward_case, gpu_only, make_q, needs_triton, ref_weight, rel_err


@needs_triton
@pytest.mark.parametrize("kernel", ["mma", "gemv"])
@pytest.mark.parametrize("case", range(6))
def test_forward_against_float64(kernel, case, poisoned):
    """fp4_gemm.fp4_linear with the kernel pinned, at odd shapes (the mma kernel: 16-bit x, K a multiple of
    64, tails of its 256-wide k-step), bias, per-row global scales, leading dims."""
    err, limit, what = forward_case(kernel, case)
    assert err <= limit, (what, err)


@needs_triton
@pytest.mark.parametrize("kernel,plan", [
    ("mma", dict(kernel="mma", ROW_TILES=2, num_warps=1, SPLIT_K=2)),
    ("gemv", dict(kernel="gemv", BLOCK_N=16, BLOCK_K=32, SPLIT_K=3)),
])
def test_split_k(kernel, plan, poisoned):
    """Split-K: fp32 partials in a workspace (poisoned too) summed by fp4_gemm's reduce kernel (the mma
    kernel: by the program that finishes a tile last), with uneven splits (K = 272 or 832 is no multiple
    of the split's K range) and tiles that overhang N and M."""
    # (check_split_k's second call also checks that the mma kernel's tile counters are back at zero)
    check_split_k(engine_plan.linear, plan, *((2, 272, 40) if kernel == "gemv" else (9, 832, 40)))


@gpu_only
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_mma_ptx_matches_its_model(dtype):
    """The mma kernel's PTX block (decode + mma.sync, lanes exchanging nothing) against the plain-Triton
    model of it (the path the CPU tests run) and the float64 reference, at shapes with a K tail, token
    tiles, split-K, rows past N and two row tiles a warp (which the old axis order spread over lanes)."""
    for M, K, N, split, rt in ((1, 3584, 200, 1, 1), (8, 1088, 136, 2, 1), (13, 576, 72, 3, 1), (8, 1088, 264, 2, 2),
                               (5, 576, 200, 1, 2)):
        q = make_q(N, K, per_row=True, seed=M + K)
        x = torch.randn(M, K, dtype=dtype, device=DEV)
        args = (q.packed, q.scale.view(torch.uint8), q.global_scale, None)
        plan = dict(kernel="mma", ROW_TILES=rt, num_warps=4, SPLIT_K=split)
        fast = engine_plan.linear(x, *args, plan)
        slow = engine_plan.linear(x, *args, dict(plan, asm=False))
        ref = x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t()
        assert rel_err(fast, slow.double().cpu()) < 2e-3  # fp32 sums in another order, then 16-bit rounding
        assert rel_err(fast, ref) < (4e-3 if dtype == torch.bfloat16 else 1e-3)

