"""Shared fixtures: tiny random Hugging Face checkpoints written with save_pretrained, so that every
test compares our code against transformers on a real folder (config.json + safetensors).

Without a GPU, Triton runs kernels only in its interpreter, which it reads from TRITON_INTERPRET once,
when triton is first imported: so it is switched on here, before any test module imports triton
(the library modules leave that choice to their callers)."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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
