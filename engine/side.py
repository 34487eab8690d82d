"""A small dense product riding along with the GEMM: decode's LoRA A products, x @ A^T.

Speeds up: rollout's decode step, where each NVFP4 projection's input also meets the group's LoRA A's
(rank r, a few rows of x). `fp4_linear_side` returns (fp4_gemm.fp4_linear(x, q, bias), x @ side^T);
where the mma kernel serves the GEMM (one row on Hopper, up to 8 elsewhere) the side product's programs
join the GEMM's own launch (engine/mma.py's `_small_part`), so a projection costs one launch, not two.
Elsewhere `side_linear` computes it: `small_linear` (one launch, split K with an in-kernel reduce) for
a few rows, cuBLAS above.
Tested against: float64 products and fp4_gemm.fp4_linear (tests/engine/test_side.py).
Measurements: results/rollout_h200.md.
"""
import torch
import triton
import triton.language as tl

import fp4_backend
import fp4_gemm
from engine import plan as engine_plan
from engine.mma import _small_part
from engine.pdl import pdl_opts, pdl_wait


@triton.jit
def _small_kernel(x_ptr, a_ptr, out_ptr, part_ptr, lock_ptr, M, K, SR, stride_xm, k_split, SPLIT: tl.constexpr,
                  SPLIT_PAD: tl.constexpr, BK: tl.constexpr, F32: tl.constexpr, PDL: tl.constexpr):
    """Program (column tile, K chunk, row tile) of small_linear."""
    pdl_wait(PDL)
    tile = tl.program_id(0)
    pid_m = tl.program_id(2)
    _small_part(x_ptr, a_ptr, out_ptr, part_ptr, lock_ptr, M, K, SR, stride_xm, pid_m, tile, tl.program_id(1),
                k_split, pid_m * tl.num_programs(0) + tile, SPLIT, SPLIT_PAD, BK, F32)


def small_linear(x2, A, bk=256):
    """x2 (M, K) @ A^T (SR, K) for a few rows (decode: M <= 64) and a small dense A (a LoRA A)
    in one launch: K split in whole blocks of bk (at most 32 chunks, so tens of programs share A's bytes),
    the last program of a tile sums the fp32 partials in order (deterministic). cuBLAS takes two
    launches here (a split-K GEMM and a reduce). x2 and A share a dtype, as does the result."""
    x2, A = x2.contiguous(), A.contiguous()
    M, K = x2.shape
    SR = A.shape[0]
    split, k_split = engine_plan._small_split(K, bk)
    out, part = engine_plan._side_outputs(x2, SR, split)
    grid = (triton.cdiv(SR, 16), split, triton.cdiv(M, 16))
    fp4_backend.launchable(_small_kernel, x2.device)[grid](
        x2, A, out, part, engine_plan._locks(x2.device, grid[0] * grid[2]), M, K, SR, x2.stride(0), k_split,
        SPLIT=split, SPLIT_PAD=triton.next_power_of_2(split), BK=bk, F32=x2.dtype == torch.float32 or not x2.is_cuda,
        num_warps=4, **pdl_opts(x2.device))
    return out


def side_linear(x2, side):
    """x2 @ side^T on the Triton path with no weight to ride along with: small_linear up to 64 rows (32
    for a K of 8192 or more), cuBLAS above, where cuBLAS (two launches: a split-K GEMM and a reduce) caught
    up at rank 32 on the H200 (results/rollout_h200.md)."""
    M, K = x2.shape
    return small_linear(x2, side) if M <= (32 if K >= 8192 else 64) else torch.nn.functional.linear(x2, side)


def _side_rides(plan, M):
    """Whether a side product rides in this plan's launch: the mma kernel's side programs cover one row
    tile (up to 8 rows)."""
    return plan["kernel"] == "mma" and 0 < M <= 8


def side_rides_along(x, q):
    """Whether fp4_linear_side(x, q, ...) computes its side product inside the GEMM's own launch (the mma
    kernel's plan: one row on a Hopper GPU, up to 8 on others) rather than in a launch of its own."""
    return (x.is_cuda and fp4_backend.uses_triton(x.device)
            and _side_rides(engine_plan._runnable_plan(x, q.packed, q.scale.view(torch.uint8)), x.shape[0]))


def fp4_linear_side(x, q, bias, side):
    """Decode's (x @ dequantize(q).T + bias, x @ side.T) for 2-D x and a small dense side (SR, K) in x's
    dtype (rollout: a group's LoRA A's). With the mma kernel (up to 8 rows) both come from one
    launch, the side's programs after the weight's: a few us more than the GEMM alone, less than a launch
    of small_linear of its own (results/rollout_h200.md). Other kernels: the GEMM, then small_linear
    (or cuBLAS) for the side; the decode engine computes those rows' side products with cuBLAS on a
    second stream instead, beside the GEMM. Not differentiable. The kernel just before in the stream must
    not write q (a decode step's weights are constants): the mma kernel loads its first codes before its
    launch wait."""
    fp4_gemm.check_operands(x, q.packed, q.scale, q.global_scale)
    if x.dim() != 2 or side.shape[1] != x.shape[1] or side.dtype != x.dtype:
        raise ValueError(f"fp4_linear_side: x {tuple(x.shape)} {x.dtype} against side {tuple(side.shape)} {side.dtype}")
    x = x if x.stride(-1) == 1 else x.contiguous()
    if not fp4_backend.uses_triton(x.device):
        return fp4_gemm.torch_linear(x, q.packed, q.scale, q.global_scale, bias), torch.nn.functional.linear(x, side)
    return linear_and_side(x, q.packed, q.scale.view(torch.uint8), q.global_scale.float(), bias, side,
                           constant_weight=True)


def linear_and_side(x2, packed, scale_u8, gs, bias, side, plan=None, constant_weight=False):
    """(engine/plan.py's linear(x2, ...), x2 @ side^T) for a small (SR, K) side in x2's dtype: with the mma
    kernel (M <= 8) both from one launch, else the GEMM and then side_linear. plan and constant_weight
    as engine/plan.py's linear takes them."""
    plan = engine_plan._runnable_plan(x2, packed, scale_u8, plan)
    if _side_rides(plan, x2.shape[0]):  # the side's programs after the weight's, in the mma kernel's launch
        return engine_plan._mma_linear(x2, packed, scale_u8, gs, bias, plan, side=side, constant_weight=constant_weight)
    y = engine_plan.linear(x2, packed, scale_u8, gs, bias, plan, constant_weight=constant_weight)
    return y, side_linear(x2, side)
