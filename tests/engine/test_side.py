"""engine/side.py: decode's small dense product (x @ A^T for a LoRA A) on its own (small_linear) and riding
along in the mma kernel's launch (fp4_linear_side), against float64 and fp4_gemm's own product.
"""
import pytest
import torch

from engine import plan as engine_plan
from engine import side as engine_side
from fp4_ref import DEV, make_q, needs_triton, ref_weight, rel_err


@needs_triton
@pytest.mark.parametrize("M,K,SR", [(1, 576, 40), (5, 48, 16), (8, 2560, 96), (17, 300, 21)])
def test_small_linear_against_float64(M, K, SR, poisoned):
    """The decode LoRA-A product (K split, the last program of a tile sums the partials) at odd shapes:
    rows past M, columns past SR, a K tail, one chunk (K = 48) and several (10 for K = 2560), a row tile
    past 16; the ticket counters back at zero and a second call bit-identical (a fixed order)."""
    g = torch.Generator().manual_seed(M * K + SR)
    x, A = torch.randn(M, K, generator=g).to(DEV), torch.randn(SR, K, generator=g).to(DEV)
    got = engine_side.small_linear(x, A)
    ref = x.double().cpu() @ A.double().cpu().t()
    assert torch.allclose(got.double().cpu(), ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(engine_side.small_linear(x, A), got)
    assert not engine_plan._locks(x.device).any()


@needs_triton
@pytest.mark.parametrize("M,K,N,SR,plan", [
    (1, 64, 40, 16, dict(kernel="mma", ROW_TILES=1, num_warps=2, SPLIT_K=1)),
    # the weight split in 2, the side's 3 chunks spread over 2 columns x 2 splits (one chunk empty)
    (3, 576, 72, 40, dict(kernel="mma", ROW_TILES=1, num_warps=2, SPLIT_K=2)),
    (8, 320, 264, 5, dict(kernel="mma", ROW_TILES=2, num_warps=1, SPLIT_K=2)),
    # no mma, or more rows than one x tile of it: the side falls back to a launch of its own
    (5, 48, 40, 21, dict(kernel="tiled", BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=4, SPLIT_K=1)),
    (9, 320, 40, 16, dict(kernel="mma", ROW_TILES=1, num_warps=2, SPLIT_K=2)),
])
def test_side_product_rides_along(M, K, N, SR, plan, poisoned):
    """fp4_linear_side: the side's programs inside the mma launch leave y exactly as the plain launch
    makes it, x @ side^T matches float64, the counters return to zero, and a second call is
    bit-identical, also with the first codes loaded before the launch wait (decode's constant_weight)."""
    q = make_q(N, K, per_row=True, seed=M + K + SR)
    g = torch.Generator().manual_seed(SR)
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEV)
    side = (torch.randn(SR, K, generator=g) * 0.1).to(torch.bfloat16).to(DEV)
    b = torch.randn(N, generator=g).to(torch.bfloat16).to(DEV)
    args = (x, q.packed, q.scale.view(torch.uint8), q.global_scale, b, plan)
    y, a = engine_side.linear_and_side(*args[:5], side, plan)
    assert torch.equal(y, engine_plan.linear(*args))
    ref = x.double().cpu() @ side.double().cpu().t()
    assert a.shape == (M, SR) and a.dtype == x.dtype and rel_err(a, ref) <= 1e-2
    y2, a2 = engine_side.linear_and_side(*args[:5], side, plan, constant_weight=True)
    assert torch.equal(y2, y) and torch.equal(a2, a) and not engine_plan._locks(x.device).any()
    # the public entry, on whichever path this machine runs
    y3, a3 = engine_side.fp4_linear_side(x, q, b, side)
    assert rel_err(y3, x.double().cpu() @ ref_weight(q.packed, q.scale, q.global_scale).t() + b.double().cpu()) <= 1e-2
    assert rel_err(a3, ref) <= 1e-2
    with pytest.raises(ValueError):
        engine_side.fp4_linear_side(x, q, b, side.float())

