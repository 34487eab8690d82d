"""The inline-PTX decodes: E2M1 codes and E4M3 scales to bf16/f16 weights in a few integer instructions.

Speeds up: the decode inside every GPU kernel (fp4_gemm's tiled kernel, engine/mma.py's mma and GEMV
kernels, engine/wgmma.py's Gluon kernels). fp4_gemm.py teaches the bit tricks and decodes in plain
Triton integer ops; here the same bit moves are written as PTX on 32-bit registers, two values an
instruction, because at decode speed an SM has only a few issue slots per weight.
Tested against: fp4_gemm's plain decode (`decode_plain`) on the GPU bit for bit, and on the CPU by
running every PTX block through `run_ptx_warp`, a small warp-wide emulator of the instructions used
(tests/engine/test_ptx.py, test_mma.py, test_wgmma.py).
Measurements: results/fp4_gemm_h200.md.
"""
import re

import numpy as np
import triton
import triton.language as tl

from fp4_gemm import e4m3_to_f32

# One PTX block per 4 packed bytes (a 32-bit register q = b3 b2 b1 b0): `prmt` puts b0, b1 in the
# high bytes of the two 16-bit halves, so the high nibbles sit at bits 12-15 / 28-31; a mask keeps
# each sign bit, a shift moves e e m under the target's exponent, and one packed multiply by the
# block scale (a pair, pre-adjusted by a power of two) finishes. `shl 4` brings the low nibbles up.
# Outputs: $0,$1 = low nibbles of b0..b3, $2,$3 = high nibbles; inputs: $4 = the bytes, $5 = the
# scales of b0, b1 and $6 those of b2, b3 (which 4 bytes an instance gets depends on the layout
# Triton picks, so each byte brings its own scale).
def _e2m1_asm(shift, mag_mask, mul):
    steps = []
    for dst, src, sc in (("$2", "a", "$5"), ("$3", "b", "$6"), ("$0", "c", "$5"), ("$1", "d", "$6")):
        steps.append(f"shr.b32 t, {src}, {shift}; and.b32 t, t, {mag_mask}; and.b32 u, {src}, 0x80008000; "
                     f"or.b32 t, t, u; {mul} {dst}, t, {sc};")
    return ("{ .reg .b32 a, b, c, d, t, u; prmt.b32 a, $4, 0, 0x1404; prmt.b32 b, $4, 0, 0x3424; "
            "shl.b32 c, a, 4; shl.b32 d, b, 4; " + " ".join(steps) + " }")

_ASM_BF16: tl.constexpr = tl.constexpr(_e2m1_asm(6, "0x01C001C0", "mul.rn.bf16x2"))  # value * 2^-126
_ASM_F16: tl.constexpr = tl.constexpr(_e2m1_asm(3, "0x0E000E00", "mul.rn.f16x2"))  # value * 2^-14

# The GEMV's decode works on one 32-bit word q of 8 codes (k0..k7 = lo b0, hi b0, ..., hi b3) and
# emits float16 pairs worth e2m1 * 2^-14 (the GEMV converts them to fp32 and applies the block scale
# after summing the block). With h = q & 0xF0F0F0F0 the high nibbles are isolated, so
# (h | h >> 3) & 0x8E008E00 keeps each sign bit and drops e e m under float16's exponent in one
# shift and one LOP3: nothing else lands on those bits. `shl 8` serves the other byte of each half,
# and l = (q << 4) & 0xF0F0F0F0 the low nibbles. Outputs: $0 = (k3, k7), $1 = (k1, k5),
# $2 = (k2, k6), $3 = (k0, k4) as (low half, high half); input $4 = q.
def _e2m1_word_asm():
    steps = []
    for dst, src in (("$0", "h"), ("$1", "h2"), ("$2", "l"), ("$3", "l2")):
        steps.append(f"shr.b32 t, {src}, 3; or.b32 t, t, {src}; and.b32 {dst}, t, 0x8E008E00;")
    return ("{ .reg .b32 h, h2, l, l2, t; and.b32 h, $4, 0xF0F0F0F0; shl.b32 l, $4, 4; "
            "and.b32 l, l, 0xF0F0F0F0; shl.b32 h2, h, 8; shl.b32 l2, l, 8; " + " ".join(steps) + " }")

_ASM_WORD: tl.constexpr = tl.constexpr(_e2m1_word_asm())


@triton.jit
def decode_ptx(p, sb, DTYPE: tl.constexpr):
    """fp4_gemm.decode_plain's contract with the PTX block above (bf16 or f16 DTYPE): bytes p (BN, BK/16, 8)
    and their E4M3 scale bytes sb (BN, BK/16) → (lo, hi), the even- and odd-k weights, exact e2m1 * s * 2^-8.
    The block scale travels pre-multiplied by the power of two the code's placement leaves out."""
    if DTYPE == tl.bfloat16:  # e2m1 * 2^-126 times scale * 2^118
        sa = e4m3_to_f32(sb, 8.507059173023462e37).to(tl.bfloat16)[:, :, None]  # (BN, BK/16, 1)
        lo, hi = tl.inline_asm_elementwise(_ASM_BF16, "=r,=r,=r,=r,r,r,r", [p, sa],
                                           dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:  # e2m1 * 2^-14 times scale * 2^6
        sa = e4m3_to_f32(sb, 16384.0).to(tl.float16)[:, :, None]
        lo, hi = tl.inline_asm_elementwise(_ASM_F16, "=r,=r,=r,=r,r,r,r", [p, sa],
                                           dtype=(tl.float16, tl.float16), is_pure=True, pack=4)
    return lo, hi


# ---- the tensor-core GEMV (up to 8 rows of x a program): Marlin's idea as one PTX block ----
# (how mma.sync's operands sit in a warp's registers, and so which k each lane decodes: engine/mma.py)
#
# The word decode both tensor-core kernels share: a 32-bit word q holds codes k0..k7 (4 bits each,
# k0 lowest) and becomes 4 registers of 2 values, (k3, k7), (k2, k6), (k1, k5), (k0, k4) (low half,
# high half), each value exactly e2m1 * 2^-126 (bf16) or * 2^-14 (f16) before the multiply by the
# scale pair. bf16: isolate one code per 16-bit half (and), then one integer multiply copies it to
# two places at once: by 2^6 + 2^12 for a code at bits 0-3 (e e m lands on bits 8..6, under bf16's
# exponent, the sign on bit 15; the two copies never overlap, so nothing carries), by 2^2 + 2^8 for
# a code at bits 4-7; a final and keeps those 4 bits. k2, k3, k6, k7 first move down a byte (shr).
# That is 9 ALU instructions a word (two ands per code pair, and the shift) and 4 multiplies on the
# FMA pipe; the f16 decode moves each pair's nibbles to bits 15..12 and 31..28 (shl), keeps the
# sign and drops e e m three bits lower (and, shr, or + and): f16's 5-bit exponent puts the two
# copies one bit apart, where the multiply would carry.
def _word_decode_ptx(word, outs, scale, f16):
    """PTX decoding register `word` into registers outs = (k3,k7), (k2,k6), (k1,k5), (k0,k4), times
    the pair in `scale` (with scratch registers n, q8 declared by the caller)."""
    if f16:
        lines = []
        for out, sl in zip(outs, (0, 4, 8, 12)):
            src = word
            if sl:
                lines.append(f"shl.b32 n, {word}, {sl};")
                src = "n"
            lines.append(f"and.b32 q8, {src}, 0xF000F000; shr.b32 n, q8, 3; or.b32 n, n, q8; "
                         f"and.b32 n, n, 0x8E008E00; mul.rn.f16x2 {out}, n, {scale};")
        return " ".join(lines)
    lines = [f"shr.b32 q8, {word}, 8;"]
    for out, src, mask, mult in zip(outs, ("q8", "q8", word, word), ("0x00F000F0", "0x000F000F") * 2,
                                    (260, 4160) * 2):
        lines.append(f"and.b32 n, {src}, {mask}; mul.lo.u32 n, n, {mult}; and.b32 n, n, 0x81C081C0; "
                     f"mul.rn.bf16x2 {out}, n, {scale};")
    return " ".join(lines)

# One PTX block per half k-step (4 words of each of the two rows):
#   scales: two E4M3 bytes per row (the blocks of words 0-1 and 2-3) → a pair each, times a power
#           of two by bit moves and a mul (value * 2^118 in bf16, * 2^6 in f16);
#   codes:  word q (8 codes, k = 8w + 0..7) → 4 registers of 2 values, (k3, k7), (k2, k6), (k1, k5),
#           (k0, k4) (_word_decode_ptx), times the scale pair: exact e2m1 * s * 2^-8;
#   x:      the lane's 8 x values of the word paired the same way (prmt);
#   MMA:    two per word, (k3,k7 | k2,k6) and (k1,k5 | k0,k4), chained into one fp32 accumulator.
# Operands: $0-$3 accumulator out; $4-$7 the 4 words of row g, $8-$11 of row g + 8; $12 / $13 the
# rows' 4 scale bytes (this half uses bytes 0, 1 or 2, 3); $14-$29 x pairs (x0,x1), (x2,x3), (x4,x5),
# (x6,x7) of the 4 words; $30-$33 accumulator in.
def _mma_asm(f16, half):
    if f16:  # scale: s * 2^-8 as f16 bits, times 2^14
        ty, sshift, smask, mul, cst = "f16", 7, "0x3F803F80", "mul.rn.f16x2", "0x74007400"
    else:  # scale: s * 2^-120 as bf16 bits, times 2^119 twice
        ty, sshift, smask, mul, cst = "bf16", 4, "0x07F007F0", "mul.rn.bf16x2", "0x7B007B00"
    regs = [f"s{r}{b}" for r in "tb" for b in "01"] + [f"w{r}{w}{p}" for r in "tb" for w in range(4) for p in range(4)]
    regs += [f"x{w}{p}" for w in range(4) for p in range(4)] + ["c", "u", "v", "n", "q8"]
    lines = [".reg .b32 " + ", ".join(regs) + ";", f"mov.b32 c, {cst};"]
    for r, src in (("t", "$12"), ("b", "$13")):  # bytes (2 half, 2 half + 1) → u = b_lo | b_hi << 16
        lines += [f"prmt.b32 u, {src}, 0, {'0x4342' if half else '0x4140'};", f"shl.b32 v, u, {sshift};",
                  f"and.b32 v, v, {smask};", "shl.b32 u, u, 8;", "and.b32 u, u, 0x80008000;", "or.b32 u, u, v;",
                  f"{mul} u, u, c;"] + ([] if f16 else [f"{mul} u, u, c;"])
        lines += [f"prmt.b32 s{r}0, u, 0, 0x1010;", f"prmt.b32 s{r}1, u, 0, 0x3232;"]
    for r, base in (("t", 4), ("b", 8)):
        for w in range(4):  # p: (k3,k7), (k2,k6), (k1,k5), (k0,k4)
            outs = [f"w{r}{w}{p}" for p in range(4)]
            lines.append(_word_decode_ptx(f"${base + w}", outs, f"s{r}{w // 2}", f16))
    for w in range(4):
        x01, x23, x45, x67 = (f"${14 + 4 * w + j}" for j in range(4))
        lines += [f"prmt.b32 x{w}0, {x23}, {x67}, 0x7632;", f"prmt.b32 x{w}1, {x23}, {x67}, 0x5410;",
                  f"prmt.b32 x{w}2, {x01}, {x45}, 0x7632;", f"prmt.b32 x{w}3, {x01}, {x45}, 0x5410;"]
    acc_in = "{$30, $31, $32, $33}"
    for w in range(4):
        for p0 in (0, 2):
            a = f"{{wt{w}{p0}, wb{w}{p0}, wt{w}{p0 + 1}, wb{w}{p0 + 1}}}"
            lines.append(f"mma.sync.aligned.m16n8k16.row.col.f32.{ty}.{ty}.f32 {{$0, $1, $2, $3}}, {a}, "
                         f"{{x{w}{p0}, x{w}{p0 + 1}}}, {acc_in};")
            acc_in = "{$0, $1, $2, $3}"
    return "{ " + " ".join(lines) + " }"

# indexed by 2 * F16 + HALF inside the kernel (triton 3.6 will not pass a string as an argument)
_ASM_MMA: tl.constexpr = tl.constexpr(tuple(_mma_asm(f16, half) for f16 in (False, True) for half in (0, 1)))
_MMA_CONSTRAINTS: tl.constexpr = tl.constexpr("=f,=f,=f,=f," + ",".join(["r"] * 26) + ",f,f,f,f")



def _wgmma_word_asm(f16):
    """8 codes of a 32-bit word ($4; pack = 8 gives the asm 8 copies, $4-$11) → 4 registers $0-$3 of
    two values each, codes (3, 7), (2, 6), (1, 5), (0, 4) of the word, times the scale pair $12 (copies
    $12-$19): the mma kernel's word decode, so the pair holds s * 2^118 (bf16) or s * 2^6 (f16) and
    the result is exactly e2m1 * s * 2^-8."""
    return "{ .reg .b32 n, q8; " + _word_decode_ptx("$4", ["$0", "$1", "$2", "$3"], "$12", f16) + " }"


# ------------------------------------------------------------------------------------------------
# A warp-wide emulator of the PTX above, so that the CPU tests can check every block
# ------------------------------------------------------------------------------------------------

def _bf16_to_f32(h):  # uint32 arrays holding 16-bit patterns → float32 values (exact)
    return (h.astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(f):  # round to nearest even
    b = f.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def _halves(v, ty):
    lo, hi = v & 0xFFFF, v >> 16
    if ty == "bf16":
        return _bf16_to_f32(lo), _bf16_to_f32(hi)
    return lo.astype(np.uint16).view(np.float16).astype(np.float32), hi.astype(np.uint16).view(np.float16).astype(np.float32)


def _pack(lo, hi, ty):
    if ty == "bf16":
        return _f32_to_bf16(lo) | (_f32_to_bf16(hi) << 16)
    return lo.astype(np.float16).view(np.uint16).astype(np.uint32) | (hi.astype(np.float16).view(np.uint16).astype(np.uint32) << 16)


def run_ptx_warp(asm, operands):
    """Run an inline-asm block for the 32 lanes of a warp at once. operands: {"$k": array (32,)} of uint32
    (float32 for the f32 accumulators); returns the registers. Implements only what the mma blocks
    use: mov, and, or, shl, shr, mul.lo.u32, prmt (default mode), mul.rn.{bf16,f16}x2 and
    mma.sync.aligned.m16n8k16.row.col.f32 with the PTX ISA's fragment layout."""
    regs = {k: np.asarray(v) for k, v in operands.items()}
    lane = np.arange(32)
    g, t = lane // 4, lane % 4

    def val(x):
        x = x.strip()
        if x in regs:
            return regs[x]
        return np.full(32, int(x, 0), dtype=np.uint64).astype(np.uint32)

    for ins in asm.strip().strip("{}").split(";"):
        ins = ins.strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, rest = ins.split(None, 1)
        if op.startswith("mma.sync"):
            ty = op.split(".")[-3]
            d, a, b, c = [[r.strip() for r in grp.split(",")] for grp in re.findall(r"\{([^}]*)\}", rest)]
            A, B, C = np.zeros((16, 16)), np.zeros((16, 8)), np.zeros((16, 8))
            for i, (rows, cols) in enumerate(((g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8))):
                lo, hi = _halves(regs[a[i]].astype(np.uint32), ty)
                A[rows, cols], A[rows, cols + 1] = lo, hi
            for i, rows in enumerate((2 * t, 2 * t + 8)):
                lo, hi = _halves(regs[b[i]].astype(np.uint32), ty)
                B[rows, g], B[rows + 1, g] = lo, hi
            for i, (rows, cols) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                C[rows, cols] = val(c[i])
            D = A @ B + C
            for i, (rows, cols) in enumerate(((g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t), (g + 8, 2 * t + 1))):
                regs[d[i]] = D[rows, cols].astype(np.float32)
            continue
        args = [x.strip() for x in rest.split(",")]
        dst, src = args[0], [val(x) for x in args[1:]]
        u = [s.astype(np.uint64) for s in src]
        if op == "mov.b32":
            out = src[0]
        elif op == "and.b32":
            out = u[0] & u[1]
        elif op == "or.b32":
            out = u[0] | u[1]
        elif op == "shl.b32":
            out = (u[0] << u[1]) & 0xFFFFFFFF
        elif op == "shr.b32":
            out = u[0] >> u[1]
        elif op == "mul.lo.u32":
            out = (u[0] * u[1]) & 0xFFFFFFFF
        elif op == "prmt.b32":
            pool = u[0] | (u[1] << 32)  # bytes 0-3 from a, 4-7 from b
            out = sum(((pool >> (8 * ((u[2] >> (4 * i)) & 7))) & 0xFF) << (8 * i) for i in range(4))
        elif op in ("mul.rn.bf16x2", "mul.rn.f16x2"):
            ty = op.split(".")[-1][:-2]
            (a0, a1), (b0, b1) = _halves(src[0].astype(np.uint32), ty), _halves(src[1].astype(np.uint32), ty)
            out = _pack(a0.astype(np.float64) * b0, a1.astype(np.float64) * b1, ty)
        else:
            raise NotImplementedError(op)
        regs[dst] = np.asarray(out).astype(np.uint32)
    return regs


