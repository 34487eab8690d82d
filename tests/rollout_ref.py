"""Shared by the sampler's tests (tests/test_rollout.py) and the decode engine's (tests/engine/test_decode.py):
a tiny HF Qwen2 model loaded into ours with nonzero LoRA, prompts, and a plain full forward to compare with."""
import torch

import lora
import model as M

# head_dim 32 so that the Triton kernels (tl.dot needs >= 16 per half-head) can run too
CFG = dict(hidden_size=64, intermediate_size=96, num_attention_heads=2, num_key_value_heads=1, vocab_size=97)


def load(hf_folder, quantize=False, with_lora=True, seed=0, **overrides):
    hf, folder = hf_folder("qwen2", seed=seed, **{**CFG, **overrides})
    ours = M.Transformer.from_pretrained(folder, dtype=torch.float32, quantize=quantize)
    if with_lora:
        lora.apply_lora(ours, rank=4, alpha=8)
        gen = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():  # nonzero B so the adapters change the logits
            for m in lora.lora_modules(ours).values():
                m.lora_B.weight.normal_(0, 0.3, generator=gen)
    return hf, ours


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def full_forward_z(model, prompt, completion, temperature):
    """z = logits / T at the positions that predicted each completion token, from one plain forward."""
    seq = torch.tensor([prompt + completion], device=model.device)
    with torch.no_grad():
        logits = model(seq)[0].double()  # (L, V)
    return logits[len(prompt) - 1: len(prompt) - 1 + len(completion)] / (temperature or 1.0)


def full_forward_logprobs(model, prompt, completion, temperature):
    """The log-probability of each completion token at temperature T, from one plain forward (full_forward_z)."""
    z = full_forward_z(model, prompt, completion, temperature)
    return torch.log_softmax(z, -1).gather(1, torch.tensor(completion, device=z.device)[:, None])[:, 0]


def rows(r):
    return [(i, r.tokens[i, : int(r.lengths[i])].tolist()) for i in range(r.tokens.shape[0])]
