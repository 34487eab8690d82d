"""fp4_backend.py: which path computes fp4_gemm's products, and what every Triton launch of them shares.

Paths. "auto": CUDA tensors go to the engine room (engine/plan.py picks a kernel per shape), CPU tensors
to fp4_gemm's torch reference. `set_backend("torch" | "triton" | "auto", kernel=None)`, the `backend(...)`
context manager or the environment variable QERL_FP4_BACKEND force one; "triton" on CPU tensors runs the
Triton kernels in Triton's interpreter, which the caller switches on (TRITON_INTERPRET=1 before triton is
first imported: tests/conftest.py does). `kernel` pins "tiled" (fp4_gemm's portable kernel) or an engine
kernel: "mma", "gemv", "wgmma", "dequant". Inside `fp8_tensor_cores()` every path gives way to FP8 tensor
cores (engine/fp8.py): train.py's --fp8-update, an option that trades exactness for a faster update.
Inside `dequant_plan()` (train.update) the engine dequantizes and calls cuBLAS at any token count.
The choice is one small dict, `choice`, read at every call (uses_triton, pinned_kernel, fp4_gemm's op).

Launches. On CPU tensors only Triton's interpreter runs kernels: `launchable` says so instead of letting
triton fail deep inside; `launch_opts` turns a plan's launch options into keywords; `k_chunk` and
`split_k` cut K into the ranges of split-K, which fp4_gemm's tiled kernel and the engine's kernels share.

fp4_gemm re-exports the choice (fp4_gemm.set_backend, .backend, .fp8_tensor_cores, ...), so its callers
name one file; the engine room takes what it uses from here. This file imports nothing of the project,
and works without Triton (then only the torch path runs).
"""
import contextlib
import os

try:
    import triton
    import triton.language  # noqa: F401  (all of Triton that fp4_gemm's kernels need)

    HAS_TRITON = True
except ImportError:  # the torch path still works
    HAS_TRITON = False


# ---------------------------------------------------------------------------------------------
# Which path runs
# ---------------------------------------------------------------------------------------------

BACKENDS = ("auto", "torch", "triton")
KERNELS = (None, "mma", "gemv", "wgmma", "tiled", "dequant")
choice = {"backend": os.environ.get("QERL_FP4_BACKEND", "auto"), "kernel": None, "fp8": False}
if choice["backend"] not in BACKENDS:  # a typo would otherwise act as "auto"
    raise ValueError(f"QERL_FP4_BACKEND={choice['backend']!r}: use one of {BACKENDS}")


def set_backend(name="auto", kernel=None):
    """"auto": Triton on CUDA tensors, torch elsewhere. "triton": always Triton (on CPU tensors through
    the interpreter, slow: for tests). "torch": dequantize + matmul. `kernel` pins the Triton kernel
    ("tiled", or the engine's "mma", "gemv", "wgmma", "dequant") instead of the per-shape plan."""
    if name not in BACKENDS or kernel not in KERNELS:
        raise ValueError(f"backend must be one of {BACKENDS} and kernel one of {KERNELS}, got {name!r}, {kernel!r}")
    choice["backend"], choice["kernel"] = name, kernel


@contextlib.contextmanager
def backend(name, kernel=None):
    """with fp4_gemm.backend("triton", kernel="gemv"): ... — restores the previous choice on exit."""
    old = dict(choice)
    set_backend(name, kernel)
    try:
        yield
    finally:
        choice.update(old)


@contextlib.contextmanager
def fp8_tensor_cores(on=True):
    """Within it (with on=True), fp4_linear and its dX multiply on FP8 tensor cores: the weight written in
    E4M3 instead of x's dtype, x (and dY) quantized to E4M3 row by row (engine/fp8.py). Faster for the large
    GEMMs of an update on Hopper, and less exact (results/fp8_update.md): train.py's --fp8-update, off by
    default, runs the update so; the rollout never does."""
    old = choice["fp8"]
    choice["fp8"] = bool(on)
    try:
        yield
    finally:
        choice["fp8"] = old


@contextlib.contextmanager
def dequant_plan():
    """Within it, the engine's products (fp4_linear and its dX) take the dequant plan at every token count:
    the layer's weight dequantized to x's dtype, then cuBLAS, unless a kernel is already pinned. train.update
    runs inside it. The plan picks a kernel and its launch config by the token count (engine/plan.py), and an
    update's micro-batches bring counts that earlier steps did not (a last slice of one short sequence), so
    that a later step would compile a kernel the first step never ran: seconds of Triton JIT in a step that
    should pay none (engine/bench_step.py counts them). Above 2,048 tokens, where an update's micro-batches
    are, the plan picks this one anyway; dequant and cuBLAS compile nothing new for a new count."""
    old = choice["kernel"]
    choice["kernel"] = old or "dequant"
    try:
        yield
    finally:
        choice["kernel"] = old


def uses_triton(device):
    """Whether fp4_linear multiplies tensors on `device` with a Triton kernel (fp4_gemm's or the engine's)
    under the current backend: "auto" on a CUDA device where Triton is installed, always with "triton",
    never with "torch"."""
    name = choice["backend"]
    if name == "torch":
        return False
    if name == "triton":
        if not HAS_TRITON:
            raise RuntimeError("backend 'triton' forced but triton is not installed")
        return True
    return HAS_TRITON and device.type == "cuda"


def pinned_kernel():
    """The kernel set_backend or backend() pinned (None: the engine's per-shape plan chooses)."""
    return choice["kernel"]


# ---------------------------------------------------------------------------------------------
# What every launch shares
# ---------------------------------------------------------------------------------------------

def launchable(kernel, device):
    """`kernel`, or a clear error where it cannot run: on CPU tensors only Triton's interpreter runs
    kernels, and triton reads TRITON_INTERPRET once, when it is first imported."""
    if device.type == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError("fp4_gemm: Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before triton "
                           "is first imported (tests/conftest.py does; or use the torch backend)")
    return kernel


def launch_opts(plan):
    """A plan's launch options (num_warps, num_stages), for a kernel's [grid](...) call."""
    return {k: plan[k] for k in ("num_warps", "num_stages") if k in plan}


def k_chunk(K, parts, bk):
    """The width of each of `parts` K ranges, rounded up to whole blocks of bk (so the last ranges may
    be short, or empty)."""
    return triton.cdiv(triton.cdiv(K, parts), bk) * bk


def split_k(K, parts, bk):
    """(splits, width): K in `parts` ranges of whole blocks of bk, fewer where the last would be empty."""
    k_split = k_chunk(K, parts, bk)
    return triton.cdiv(K, k_split), k_split
