"""Shared fixtures: tiny random Hugging Face checkpoints written with save_pretrained, so that every
test compares our code against transformers on a real folder (config.json + safetensors).

Without a GPU, Triton runs kernels only in its interpreter, which it reads from TRITON_INTERPRET once,
when triton is first imported: so it is switched on here, before any test module imports triton
(the library modules leave that choice to their callers). With a GPU, CUDA is started here, before any test:
torch refuses a checkpointed forward during which CUDA first starts, as torch.compile may start it inside a
CPU model's checkpointed blocks on a GPU machine."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    torch.cuda.init()

import pytest  # noqa: E402


def make_hf_model(arch="qwen2", seed=0, **overrides):
    """A tiny random transformers model. Sizes are multiples of 16 so NVFP4 can quantize them."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    kw = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=False)
    kw.update(overrides)
    torch.manual_seed(seed)
    if arch == "qwen2":
        return Qwen2ForCausalLM(Qwen2Config(**kw)).eval()
    return LlamaForCausalLM(LlamaConfig(**kw)).eval()


@pytest.fixture
def hf_folder(tmp_path):
    """Factory: hf_folder(arch, **config) → (transformers model, folder it was saved to)."""
    def make(arch="qwen2", max_shard_size=None, **overrides):
        hf = make_hf_model(arch, **overrides)
        folder = tmp_path / f"{arch}-{len(list(tmp_path.iterdir()))}"
        if max_shard_size:
            hf.save_pretrained(folder, max_shard_size=max_shard_size)
        else:
            hf.save_pretrained(folder)
        return hf, str(folder)
    return make


@pytest.fixture
def poisoned(monkeypatch):
    """Every float buffer created with torch.empty starts as NaN for the duration of the test, so an output
    element a kernel forgot to write fails the comparison."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture
def small_fs(tmp_path):
    """A real, small filesystem, for what a full disk does: small_fs(size, code) runs `python -c code` in a
    child process that sees a tmpfs of `size` (e.g. "64k") mounted on the returned folder, in a mount
    namespace of its own (unshare -rm: no root needed where user namespaces are allowed), and returns the
    CompletedProcess. What the child writes there is gone when it exits: the code prints what the test
    checks. Skips, saying why, where the system cannot make one."""
    import shutil
    import subprocess
    import sys

    mnt = tmp_path / "small"
    mnt.mkdir()
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare(1) on this system: a small real filesystem needs a private mount namespace")

    def run(size, code):
        script = 'mount -t tmpfs -o "size=$1" tmpfs "$2" || exit 97; shift 2; exec "$@"'
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
        p = subprocess.run([unshare, "-rm", "sh", "-c", script, "sh", size, str(mnt), sys.executable, "-c", code],
                           cwd=root, env=env, capture_output=True, text=True)
        if p.returncode == 97 or (p.returncode != 0 and p.stderr.startswith("unshare:")):
            pytest.skip(f"cannot mount a small tmpfs in a private namespace here: {p.stderr.strip()}")
        return p

    run.folder = str(mnt)
    return run


@pytest.fixture
def tree():
    """tree(folder) -> {relative path: sha256 of the file, or "link:" + where a link points} of everything
    under folder (links not followed): a folder's state before and after a command, to compare."""
    import hashlib

    def snapshot(folder):
        out = {}
        for d, dirs, names in os.walk(folder):
            for n in names + [x for x in dirs if os.path.islink(os.path.join(d, x))]:
                p = os.path.join(d, n)
                out[os.path.relpath(p, folder)] = ("link:" + os.readlink(p) if os.path.islink(p)
                                                   else hashlib.sha256(open(p, "rb").read()).hexdigest())
        return out

    return snapshot
