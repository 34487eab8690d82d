"""Throwaway (results/engine_floor_h100.md, its last section): the decode's GEMM kernels compiled for sm_90a on the
CPU (Triton's compiler and the ptxas and cuobjdump it ships; no GPU), and the SASS instructions of their k-step
loops counted by kind, with each cubin's registers. At the plan's 7B gate|up configs: the mma kernel at one row
(with and without the LoRA A side programs the decode puts in its launch), the plain wgmma kernel at 2-16 rows,
the warp-specialized one at 64 rows.

    OMP_NUM_THREADS=1 python results/engine_floor_raw/sass_loops.py
"""
import collections, os, re, subprocess, sys, tempfile

sys.path[:0] = [".", "tests", "tests/engine"]
import torch, triton

from engine import wgmma
from engine.mma import _mma_kernel
from engine.plan import _ws_consumer_regs, _ws_maxnreg
from test_wgmma import compile_for_hopper, mangle_type

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")


def sass_and_regs(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([f"{BIN}/cuobjdump", "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([f"{BIN}/cuobjdump", "-res-usage", f.name], capture_output=True, text=True).stdout
    return text, re.search(r"REG:(\d+)", res).group(1)


def report(name, cubin):
    """The loops (a branch back to an earlier address) that hold MMAs, innermost only, by opcode."""
    text, regs = sass_and_regs(cubin)
    ins = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    back = [(int(m.group(1), 16), a) for a, t in ins for m in [re.search(r"BRA.*?0x([0-9a-f]+)", t)]
            if m and int(m.group(1), 16) < a]
    print(f"== {name}: {regs} registers a thread, {len(ins)} instructions")
    for lo, hi in back:
        body = [t for a, t in ins if lo <= a <= hi]
        inner = not any(lo < l2 and h2 <= hi and (l2, h2) != (lo, hi) for l2, h2 in back)
        if inner and any("MMA" in t for t in body):
            kinds = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
            counts = ", ".join(f"{k} {v}" for k, v in kinds.most_common())
            print(f"  loop of {len(body)} instructions a warp: {counts}")


print(f"# triton {triton.__version__}, sm_90a, offline; the GPU's triton may allocate registers differently")
mma_types = dict(x_ptr="*bf16", wp_ptr="*u8", ws_ptr="*u8", gs_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16",
                 part_ptr="*fp32", lock_ptr="*i32", side_ptr="*bf16", side_out_ptr="*bf16", side_part_ptr="*fp32",
                 **{n: "i32" for n in ("M", "N", "K", "stride_xm", "stride_ym", "stride_wn", "stride_sn", "k_split",
                                       "SR", "n_w", "side_k_split")})
for cols in (0, 4):  # gate|up at one row: split 4; the side's 14 K chunks over 4 columns x the 4 splits
    k = compile_for_hopper(_mma_kernel, mma_types, dict(ROW_TILES=1, NUM_WARPS=4, SPLIT_K=4, GS_PER_ROW=True,
                           HAS_BIAS=False, EVEN_K=True, USE_ASM=True, F16=False, SIDE_COLS=cols, SIDE_SPLIT=16,
                           SIDE_PAD=16, SIDE_F32=False, W_EARLY=True, PDL=True))
    report(f"mma kernel, one row, split 4, {'with' if cols else 'without'} side programs (64 weight rows x 256 k "
           f"a k-step: 4,096 weights a warp)", k.asm["cubin"])

plain_types = dict(x_ptr="*bf16", wp_ptr="*u8", ws_ptr="*u8", gs_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16",
                   part_ptr="*fp32", lock_ptr="*i32", **{n: "i32" for n in ("M", "N", "n_steps", "stride_xm",
                   "stride_ym", "stride_wn", "stride_sn", "split_steps")})
k = compile_for_hopper(wgmma._wgmma_kernel, plain_types, dict(BT=16, BK=256, SPLIT_K=1, GS_PER_ROW=True,
                       HAS_BIAS=False, F16=False, PDL=True))
report("plain wgmma kernel, 2-16 rows (BT 16, k-steps of 256: 4,096 weights a warp)", k.asm["cubin"])

x = torch.zeros(64, 512, dtype=torch.bfloat16)
words, scale = torch.zeros(192, 64, dtype=torch.int32), torch.zeros(192, 32, dtype=torch.uint8)
descs = dict(zip(("x_desc", "w_desc", "s_desc"), map(mangle_type, wgmma.ws_descriptors(x, words, scale, 64))))
ws_types = dict(descs, gs_ptr="*fp32", bias_ptr="*bf16", y_ptr="*bf16", part_ptr="*fp32", lock_ptr="*i32",
                **{n: "i32" for n in ("M", "N", "n_steps", "stride_ym", "split_steps", "tiles_n", "whole", "m_tiles",
                                      "group_m", "stream_from", "sk_per")})
k = compile_for_hopper(wgmma._wgmma_ws_kernel, ws_types, dict(BT=64, STAGES=2, NWG=3, SPLIT_K=2, WHOLE=True,
                       PERSIST=False, STREAM=False, GS_PER_ROW=True, HAS_BIAS=False, F16=False, PDL=True,
                       CONSUMER_REGS=_ws_consumer_regs(3)), maxnreg=_ws_maxnreg(3))
report("warp-specialized wgmma kernel, 64 rows (BT 64, three consumer warpgroups: 4,096 weights a consumer warp "
       "a k-step)", k.asm["cubin"])
