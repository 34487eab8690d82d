"""x in the wgmma kernel's K order, and the API for a caller that stores x in that order itself.

Speeds up: the wgmma kernels' right operand. Each lane decodes the weight words it loads into the
pairs (k3, k7), (k2, k6), (k1, k5), (k0, k4) and uses them as wgmma's left operand as they are, so x
must follow the same permutation of K (`wgmma_k_order`). `k_ordered` permutes x in one launch before
the GEMM; a caller whose own kernel produces x (rollout's decode step) can store it permuted
(`k_ordered_tile`) and call `fp4_linear_k_ordered`, which skips that launch (`x_k_order` says when).
Tested against: torch indexing with `wgmma_k_order` (tests/engine/test_korder.py, which also checks what
fp4_linear_k_ordered refuses); the decode's kernels that store x in K order, on the CPU with the GEMM given x
back in natural order (tests/engine/test_decode.py::test_kernels_store_their_outputs_in_the_next_gemms_k_order),
and on a GPU end to end, the logprobs of such a decode against the model's full forward
(tests/engine/test_decode.py::test_gpu_nvfp4_lora_decode_in_bf16).
Measurements: results/rollout_h200.md, results/fp4_gemm_h200.md.
"""
import torch
import triton
import triton.language as tl

import fp4_backend
import fp4_gemm
from engine.pdl import pdl_opts, pdl_wait


def wgmma_k_order(K, bk, device):
    """The wgmma kernel's K order: x_perm[:, i] = x[:, order[i]]. In each k-step of bk, MMA column 16 c +
    8 b + 2 t + h (chunk c = 2 j + a, lane t) holds element e = 4 a + 2 b + h of the lane's decoded word
    j, which is code 3 - (2 a + b) + 4 h of the word (the decode emits codes (3, 7), (2, 6), (1, 5), (0,
    4)): physical k (bk/4) t + 8 j + that. The reference that the tests hold k_ordered to (the kernel
    computes the same formula per column, with no index tensor)."""
    col = torch.arange(bk, device=device)
    c, b, t, h = col // 16, (col // 8) % 2, (col // 2) % 4, col % 2
    phys = (bk // 4) * t + 8 * (c // 2) + 3 - (2 * (c % 2) + b) + 4 * h
    return (torch.arange(0, K, bk, device=device)[:, None] + phys[None, :]).reshape(-1)


@triton.jit
def _k_order_kernel(x_ptr, out_ptr, M, K, stride_xm, stride_xk, BK: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    """Program p < cdiv(K, BLOCK) · M: out[m, k] = x[m, wgmma_k_order[k]] for BLOCK columns k of row m
    (the same formula as wgmma_k_order, without an index tensor). x was just written by the kernel
    before: the gathers hit L2."""
    pdl_wait(PDL)
    blocks = tl.cdiv(K, BLOCK)
    p = tl.program_id(0)
    m = (p // blocks).to(tl.int64)
    k = (p % blocks) * BLOCK + tl.arange(0, BLOCK)
    col = k % BK
    c, b, t, h = col // 16, (col // 8) % 2, (col // 2) % 4, col % 2
    phys = (BK // 4) * t + 8 * (c // 2) + 3 - (2 * (c % 2) + b) + 4 * h
    ok = k < K
    tl.store(out_ptr + m * K + k, tl.load(x_ptr + m * stride_xm + ((k - col) + phys) * stride_xk, mask=ok), mask=ok)


def k_ordered(x2, bk, out=None):
    """x2 (M, K) permuted along K into the wgmma kernel's order (x2[:, wgmma_k_order(K, bk)]) in one
    Triton launch (faster than torch's index_select, a general gather: results/fp4_gemm_h200.md).
    out: a contiguous (>= M, K) buffer for it (rows past M left as they are)."""
    M, K = x2.shape
    out = torch.empty(M, K, dtype=x2.dtype, device=x2.device) if out is None else out
    if M:
        block = 1024
        fp4_backend.launchable(_k_order_kernel, x2.device)[(triton.cdiv(K, block) * M,)](
            x2, out, M, K, *x2.stride(), BK=bk, BLOCK=block, num_warps=4, **pdl_opts(x2.device))
    return out


@triton.jit
def k_ordered_tile(v, R: tl.constexpr, C: tl.constexpr, BK: tl.constexpr):
    """A tile v (R, C) of rows of x, C a multiple of BK and starting at a multiple of BK, with its columns
    in the wgmma kernel's K order (wgmma_k_order), for a kernel that stores x for the warp-specialized
    wgmma kernel itself (x_k_order): a k-step's column phys = (BK/4) t + 8 j + 4 h + r goes to column
    16 (2 j + a) + 8 b + 2 t + h with 2 a + b = 3 - r. Moves registers only (through shared memory),
    so the store stays contiguous."""
    v = tl.flip(tl.reshape(v, (R, C // BK, 4, BK // 32, 2, 4)), 5)  # (row, step, t, j, h, 2a + b)
    v = tl.permute(tl.reshape(v, (R, C // BK, 4, BK // 32, 2, 2, 2)), (0, 1, 3, 5, 6, 2, 4))  # (.., j, a, b, t, h)
    return tl.reshape(v, (R, C))


def _x_rows(M, plan):
    """Rows of x a wgmma plan's programs read: M rounded up to whole tiles of BT. The rows past M are never
    stored (the plain kernel masks them, the warp-specialized variant's TMA copies read whole tiles: a tile
    crossing the end of x, zero-filled by TMA, is much slower)."""
    return triton.cdiv(M, plan["BT"]) * plan["BT"]


def _k_step_of(plan):
    """The k-step of a warp-specialized wgmma plan (its x in that K order), else 0."""
    return plan["BLOCK_K"] if plan["kernel"] == "wgmma" and "STAGES" in plan else 0


def x_k_order(M, q, dtype, device):
    """For M rows of x in `dtype` against the NVFP4 weight q: (k_step, rows) where the plan's kernel is the
    warp-specialized wgmma one (plan_forward says at which rows: on Hopper, from a few tens of rows of x,
    its persistent stream-K form included), which reads x in the K order (wgmma_k_order) of its k-steps
    and in whole tiles of rows; else (0, M). A caller whose own kernel produces x may store it in that
    order (k_ordered_tile), as the first M rows of a buffer of `rows`, and call fp4_linear_k_ordered,
    which then skips the K-order launch (rollout's decode step). The plain wgmma kernel (the fewer rows
    below those) is not offered: there the decode step measured slower without the K-order launch
    (results/rollout_h200.md)."""
    from engine import plan as engine_plan  # (here, not at the top: engine/plan.py imports this module)

    N, K = q.packed.shape[0], q.packed.shape[1] * 2
    if device.type != "cuda" or not fp4_backend.uses_triton(device):
        return 0, M
    plan = engine_plan.plan_forward(M, N, K, dtype, device)
    if not (_k_step_of(plan) and engine_plan._tma_fits(q.packed, q.scale.view(torch.uint8))):
        return 0, M
    return _k_step_of(plan), _x_rows(M, plan)


def fp4_linear_k_ordered(x, q, bias=None):
    """x @ dequantize(q).T + bias for 2-D x stored as x_k_order(len(x), q, ...) says (its k_step > 0):
    the warp-specialized wgmma kernel without the launch that orders x. Not differentiable; rollout's
    decode step."""
    from engine import plan as engine_plan  # (here, not at the top: engine/plan.py imports this module)

    fp4_gemm.check_operands(x, q.packed, q.scale, q.global_scale)
    return engine_plan.linear(x, q.packed, q.scale.view(torch.uint8), q.global_scale.float(), bias, x_k_ordered=True)
