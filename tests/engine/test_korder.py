"""engine/korder.py: x in the wgmma kernel's K order (the permutation kernel against torch indexing with
wgmma_k_order, which test_wgmma.py checks against the decode), and the API for callers that store x in
that order themselves.
"""
import pytest
import torch

import fp4_gemm
import nvfp4
from engine import korder
from fp4_ref import DEV


@pytest.mark.parametrize("M,K,bk,dtype,strided", [(3, 256, 128, torch.bfloat16, False),
                                                  (5, 768, 256, torch.float16, True),
                                                  (1, 2176, 128, torch.float32, True)])
def test_k_ordered_kernel_is_wgmma_k_order(M, K, bk, dtype, strided, poisoned):
    """The Triton permutation in front of the wgmma kernel (k_ordered, its own copy of the order's
    formula) moves every element where wgmma_k_order (checked against the decode above) says, for
    row-strided and column-strided x; K = 2176 spans more than two of its blocks of 1024."""
    x = torch.randn(M, 2 * K, generator=torch.Generator().manual_seed(M + K)).to(DEV, dtype)
    x = x[:, ::2] if strided else x[:, :K]
    got = korder.k_ordered(x, bk)
    assert torch.equal(got, x.index_select(1, korder.wgmma_k_order(K, bk, x.device)))


def test_x_in_k_order_needs_the_warp_specialized_kernel():
    """fp4_linear_k_ordered takes x in the warp-specialized wgmma kernel's K order only where the plan
    runs that kernel (x_k_order's k_step > 0: on a Hopper GPU, at the rows plan_forward gives it); anywhere else
    it refuses rather than multiply a permuted x."""
    q = nvfp4.quantize(torch.randn(64, 256, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(40, 256, dtype=torch.bfloat16)
    assert korder.x_k_order(40, q, torch.bfloat16, x.device) == (0, 40)
    with fp4_gemm.backend("triton"), pytest.raises(ValueError, match="K order"):
        korder.fp4_linear_k_ordered(x, q)
