"""engine/ptx.py: the inline-PTX decodes against fp4_gemm's plain decode and float64.

On the CPU every PTX block runs through engine/ptx.py's warp-wide emulator (run_ptx_warp); on a GPU the
compiled PTX decode must build the same exact weights as fp4_gemm's plain-Triton decode (_decode_plain).
"""
import numpy as np
import pytest
import torch

from engine import plan as engine_plan
from engine import ptx
from engine.ptx import _bf16_to_f32, _f32_to_bf16, _halves, _pack, run_ptx_warp
from fp4_ref import DEV, E2M1_SIGNED, gpu_only, make_q, rel_err


@gpu_only
def test_gpu_ptx_decode_matches_plain_decode():
    """The PTX decode (GPU) builds the same exact weights as the plain Triton decode: the tiled
    kernel's outputs agree bit for bit, the GEMV (different summation order) to fp32 rounding."""
    q = make_q(264, 272, per_row=True, seed=80)
    x = torch.randn(17, 272, dtype=torch.bfloat16, device=DEV)
    args = (q.packed, q.scale.view(torch.uint8), q.global_scale, None)
    for bn, bk in ((32, 64), (64, 256)):
        plan = dict(kernel="tiled", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, SPLIT_K=1, num_warps=4,
                    num_stages=2)
        fast = engine_plan.linear(x, *args, plan)
        slow = engine_plan.linear(x, *args, dict(plan, asm=False))
        assert torch.equal(fast, slow)
    plan = dict(kernel="gemv", BLOCK_N=16, BLOCK_K=256, SPLIT_K=1, num_warps=4)
    fast = engine_plan.linear(x[:1].float(), *args, plan)
    slow = engine_plan.linear(x[:1].float(), *args, dict(plan, asm=False))
    assert rel_err(fast, slow.double().cpu()) < 1e-6



@pytest.mark.parametrize("f16", [False, True])
@pytest.mark.parametrize("half", [0, 1])
def test_mma_ptx_block_emulated(f16, half):
    """The PTX block the mma kernel runs (decode + scale + mma.sync over a warp), executed by a CPU
    emulator of its instructions, against float64 on the same lane layout: lane 4g + t holds words
    k = 8w + i of rows g and g + 8 (w = 0..3), x of token g at the same k, and gets rows g / g + 8 at
    tokens 2t / 2t + 1. tests/engine/test_mma.py checks the real PTX against the kernel's model on a GPU."""
    rng = np.random.default_rng(7 + 2 * half + f16)
    words = {r: rng.integers(0, 2**32, (32, 4), dtype=np.uint64).astype(np.uint32) for r in ("top", "bot")}
    sbytes = {r: rng.integers(0, 0x7F, (32, 4)).astype(np.uint8) | (rng.integers(0, 2, (32, 4)) << 7).astype(np.uint8)
              for r in ("top", "bot")}  # E4M3 scales (no NaN code 0x7F/0xFF), either sign
    x = rng.standard_normal((32, 4, 8)).astype(np.float32)  # lane, word, i
    if f16:
        xbits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    else:
        xbits = _f32_to_bf16(x)
    xq = (xbits[:, :, 0::2] | (xbits[:, :, 1::2] << 16)).astype(np.uint32)  # (lane, word, pair j): (x[2j], x[2j+1])
    acc = rng.standard_normal((32, 4)).astype(np.float32)
    ops = {}
    for i in range(4):
        ops[f"${4 + i}"], ops[f"${8 + i}"] = words["top"][:, i], words["bot"][:, i]
        ops[f"${30 + i}"] = acc[:, i]
    for r, k in (("top", 12), ("bot", 13)):
        s = sbytes[r].astype(np.uint32)
        ops[f"${k}"] = s[:, 0] | (s[:, 1] << 8) | (s[:, 2] << 16) | (s[:, 3] << 24)
    for w in range(4):
        for j in range(4):
            ops[f"${14 + 4 * w + j}"] = xq[:, w, j]
    asm = ptx._mma_asm(f16, half)
    regs = run_ptx_warp(asm, ops)
    got = np.stack([regs[f"${i}"] for i in range(4)], 1).astype(np.float64)  # (lane, 4)

    e2m1 = np.array(E2M1_SIGNED)
    xv = (x.astype(np.float16) if f16 else _bf16_to_f32(xbits)).astype(np.float64)  # (lane, word, i)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    want = np.zeros((32, 4))
    for r_i, r in enumerate(("top", "bot")):
        codes = (words[r][:, :, None].astype(np.int64) >> (4 * np.arange(8))) & 0xF  # (lane, word, i)
        scale = torch.tensor(sbytes[r]).view(torch.float8_e4m3fn).double().numpy()  # (lane, 4 bytes)
        wv = e2m1[codes] * scale[:, [2 * half + wi // 2 for wi in range(4)]][:, :, None] / 256  # * 2^-8
        for L in range(32):
            for c_i, tok in enumerate((2 * t[L], 2 * t[L] + 1)):
                quad = (g == g[L])  # lanes holding row g[L] (one per t')
                src = (g == tok)  # lanes holding token `tok` (one per t')
                want[L, 2 * r_i + c_i] = acc[L, 2 * r_i + c_i] + (wv[quad] * xv[src]).sum()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_decode_ptx_blocks_emulated():
    """The GEMV's word decode and the tiles' byte decode (PTX, GPU only) on the CPU emulator: every code
    comes out as e2m1 * 2^-14 (float16 pairs), or as e2m1 * scale in bf16 / float16 pairs."""
    rng = np.random.default_rng(3)
    e2m1 = np.array(E2M1_SIGNED)
    q = rng.integers(0, 2**32, 32, dtype=np.uint64).astype(np.uint32)  # one word of 8 codes a lane
    code = lambda k: (q.astype(np.int64) >> (4 * k)) & 0xF  # k = 2 * byte + nibble
    regs = run_ptx_warp(ptx._e2m1_word_asm(), {"$4": q})
    for out, (k_lo, k_hi) in (("$0", (3, 7)), ("$1", (1, 5)), ("$2", (2, 6)), ("$3", (0, 4))):
        lo, hi = _halves(regs[out], "f16")
        np.testing.assert_array_equal(lo * 2.0**14, e2m1[code(k_lo)])
        np.testing.assert_array_equal(hi * 2.0**14, e2m1[code(k_hi)])
    for ty, shift, mask, mul, power in (("bf16", 6, "0x01C001C0", "mul.rn.bf16x2", 126),
                                        ("f16", 3, "0x0E000E00", "mul.rn.f16x2", 14)):
        # decoded codes read e2m1 * 2^-power; the kernels' scale pair is s * 2^power (s exact, few bits)
        s = rng.choice([0.5, 0.75, 1.0, 1.5, 2.0, 3.0], (32, 4))  # each byte's own scale
        sp = (s * 2.0**power).astype(np.float32)
        regs = run_ptx_warp(ptx._e2m1_asm(shift, mask, mul),
                            {"$4": q, "$5": _pack(sp[:, 0], sp[:, 1], ty), "$6": _pack(sp[:, 2], sp[:, 3], ty)})
        for out, (b_lo, b_hi), nib in (("$0", (0, 1), 0), ("$1", (2, 3), 0), ("$2", (0, 1), 1), ("$3", (2, 3), 1)):
            lo, hi = _halves(regs[out], ty)
            np.testing.assert_array_equal(lo, e2m1[code(2 * b_lo + nib)] * s[:, b_lo])
            np.testing.assert_array_equal(hi, e2m1[code(2 * b_hi + nib)] * s[:, b_hi])

