"""Shared by the LoRA tests (tests/test_lora.py) and the adapter-file tests (tests/test_adapters.py): ids,
our model loaded from a tiny HF folder, and random adapters and norms (so that they change the logits)."""
import torch

import lora
from model import Transformer


def tokens(vocab, B=2, T=7, seed=0):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def randomize_adapters(model, seed=1, std=0.05):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_A.weight.copy_(torch.randn(m.lora_A.weight.shape, generator=g) * std)
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * std)


def ours(folder, **kw):
    return Transformer.from_pretrained(folder, dtype=torch.float32, **kw)


def randomize_norms(model, seed=2, std=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in lora.trained_norms(model).values():
            w.add_(torch.randn(w.shape, generator=g) * std)
