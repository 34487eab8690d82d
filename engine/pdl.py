"""Programmatic dependent launch (PDL): a kernel may be scheduled while the one before it finishes.

Speeds up: the gaps between the many small kernels of a decode step (engine/mma.py, engine/wgmma.py,
engine/side.py, engine/korder.py and the decode step's kernels in engine/decode_kernels.py all launch
with `pdl_opts`). Changes no result: every kernel waits (`pdl_wait`) before it touches memory an earlier
kernel writes, so each still finishes after all those before it, as in plain stream order. Tested
against: the same graphed LoRA rollout launched without it, tokens and logprobs bit for bit
(tests/engine/test_decode.py::test_gpu_programmatic_launch_gives_the_same_rollout); where the launch
option is given, tests/engine/test_plan.py.
QERL_PDL=0 turns it off. Measurements: results/rollout_h200.md.
"""
import functools
import os

import torch
import triton
import triton.language as tl

try:  # (Hopper and newer; the instructions exist in triton 3.6 on)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:
    HAS_PDL = False

ENABLED = os.environ.get("QERL_PDL", "1") != "0"  # read by pdl_opts at each call (tests switch it)


@functools.lru_cache(maxsize=None)
def capability(device):
    """(major, minor) of a CUDA device, (0, 0) for anything else. Asked on every call of a layer: cached."""
    cuda = device.type == "cuda" and torch.cuda.is_available()
    return torch.cuda.get_device_capability(device) if cuda else (0, 0)


def pdl_opts(device):
    """Launch options for a kernel that calls pdl_wait: programmatic dependent launch on a Hopper or newer
    GPU, unless QERL_PDL=0; elsewhere (older GPUs, the interpreter) a plain launch, and pdl_wait does
    nothing. Inside the decode step's CUDA graph this hides most of the gap between kernels
    (results/rollout_h200.md)."""
    if ENABLED and HAS_PDL and capability(device) >= (9, 0):
        return dict(PDL=True, launch_pdl=True)
    return dict(PDL=False)


# Programmatic dependent launch (pdl_opts): a kernel launched with it may be scheduled before the
# kernel ahead of it in the stream has finished, as that one's programs exit, so launch latency and
# tail overlap. It must then wait (griddepcontrol.wait) before it reads memory that earlier kernels
# write or writes memory that they read; the kernels here wait before any such access, on every
# path, so each still finishes after all those before it, as in plain stream order. Reading what the
# kernel before does not write may come first: engine/decode_kernels.py's small kernels load their
# LoRA B's and norm weights before the wait, and the mma kernel, for decode, its first codes, which then
# overlaps those loads with the kernel before. (Until the wait returns, even what the kernel before wrote
# and then exited may not be visible yet.)
@triton.jit
def pdl_wait(PDL: tl.constexpr):
    if PDL:
        gdc_wait()


# The kernel after this one may launch once every program of this one has called this (or exited),
# instead of when they have all exited. The GEMMs call it after their k loop: the next kernel's
# launch then overlaps their split-K epilogue, and as it still waits before reading their output,
# nothing else changes (what it gained: results/rollout_h200.md).
@triton.jit
def pdl_launch_next(PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()
