"""AQN: the schedule at every stage boundary (hand-computed), the noise really reaching the model
(the count of perturbed norms, logits moving, on our model, transformers' and a model whose norm
class is foreign, the bug of the official hook), exact in-place restore (also after an exception),
the noise's statistics, and entropy of sampled text rising with sigma on a tiny trained model."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import aqn
from model import Config, RMSNorm, Transformer

# sigma_k = 1e-2 * (5e-4 / 1e-2) ** ((k - 1) / 8) for k = 1..9, worked out by hand (0.05^(1/8) = 0.68766…).
PAPER = [0.0, 1.0e-2, 6.8766e-3, 4.7287e-3, 3.2518e-3, 2.2361e-3, 1.5377e-3, 1.0574e-3, 7.2713e-4, 5.0e-4]
# The official scripts' sigma_end 1e-4: ratio 0.01^(1/8) = 0.56234….
OFFICIAL = [0.0, 1.0e-2, 5.6234e-3, 3.1623e-3, 1.7783e-3, 1.0e-3, 5.6234e-4, 3.1623e-4, 1.7783e-4, 1.0e-4]


def small_config(hidden=64, layers=2, vocab=53):
    return Config({"model_type": "qwen2", "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden,
                   "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2})


def norm_weights(model):
    return {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, RMSNorm)}


# ---------------------------------------------------------------------------------------------
# Schedule
# ---------------------------------------------------------------------------------------------

def test_schedule_every_stage_boundary():
    s = aqn.AQNSchedule(100, sigma_end=5e-4)  # the paper's text: 10 stages, 1e-2 → 5e-4
    for k in range(10):
        first, last = 10 * k, 10 * k + 9
        assert s.stage(first) == k and s.stage(last) == k
        assert s.sigma(first) == pytest.approx(PAPER[k], rel=1e-4)
        assert s.sigma(last) == pytest.approx(PAPER[k], rel=1e-4)
    assert s.sigma(0) == 0.0 and s.sigma(9) == 0.0  # stage 0 is noise-free
    assert s.stage(-5) == 0 and s.stage(100) == 9 and s.stage(10**6) == 9  # clamped
    official = aqn.AQNSchedule(100)  # the defaults: the official scripts' 1e-2 → 1e-4
    assert [official.sigma(10 * k) for k in range(10)] == pytest.approx(OFFICIAL, rel=1e-4)


def test_schedule_uneven_steps_and_few_stages():
    # 37 steps in 10 stages: stage k starts at ceil(37k/10) = 0, 4, 8, 12, 15, 19, 23, 26, 30, 34.
    s = aqn.AQNSchedule(37)
    starts = [0, 4, 8, 12, 15, 19, 23, 26, 30, 34]
    assert [s.stage(t) for t in starts] == list(range(10))
    assert [s.stage(t - 1) for t in starts[1:]] == list(range(9))
    assert s.stage(36) == 9
    # K = 3: one noise-free stage, then sigma_start, then sigma_end. K = 2: only sigma_start.
    s3 = aqn.AQNSchedule(30, stages=3, sigma_start=0.02, sigma_end=0.001)
    assert [s3.sigma(t) for t in (0, 9, 10, 19, 20, 29)] == pytest.approx([0, 0, 0.02, 0.02, 0.001, 0.001])
    s2 = aqn.AQNSchedule(10, stages=2)
    assert [s2.sigma(t) for t in (0, 4, 5, 9)] == pytest.approx([0, 0, 1e-2, 1e-2])
    # Fewer steps than stages: stages are skipped, the last step still gets sigma_end.
    s4 = aqn.AQNSchedule(4)
    assert [s4.stage(t) for t in range(4)] == [0, 2, 5, 7]
    with pytest.raises(ValueError):
        aqn.AQNSchedule(0)
    with pytest.raises(ValueError):
        aqn.AQNSchedule(10, stages=1)
    with pytest.raises(ValueError):
        aqn.AQNSchedule(10, sigma_end=0)


# ---------------------------------------------------------------------------------------------
# The noise reaches the model, and leaves no trace
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("final_norm", [False, True])
def test_noise_reaches_every_decoder_norm_and_restores_exactly(final_norm):
    torch.manual_seed(0)
    model = Transformer(small_config(layers=3)).eval()
    tok = torch.randint(0, 53, (2, 9))
    clean_logits = model(tok)
    before = norm_weights(model)
    ptrs = {n: m.weight.data_ptr() for n, m in model.named_modules() if isinstance(m, RMSNorm)}
    with aqn.noise(model, 1e-2, generator=torch.Generator().manual_seed(1), final_norm=final_norm) as info:
        during = norm_weights(model)
        changed = sorted(n for n in before if not torch.equal(before[n], during[n]))
        # Counted independently of aqn: the official hook's failure mode would give 0 here.
        assert len(changed) == 2 * 3 + int(final_norm) == info.modified == len(info.names)
        assert ("norm" in changed) == final_norm
        assert {n.split(".")[-1] for n in changed} - {"norm"} == {"input_layernorm", "post_attention_layernorm"}
        # In place: the same memory (what a captured CUDA graph reads) holds the noisy weights.
        assert all(m.weight.data_ptr() == ptrs[n] for n, m in model.named_modules() if isinstance(m, RMSNorm))
        noisy_logits = model(tok)
        assert (noisy_logits - clean_logits).abs().max() > 1e-4
    after = norm_weights(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert torch.equal(model(tok), clean_logits)


def test_restore_after_exception_and_sigma_zero():
    torch.manual_seed(1)
    model = Transformer(small_config())
    for m in model.modules():  # non-trivial weights, so that restoring to ones would not pass
        if isinstance(m, RMSNorm):
            m.weight.data.uniform_(0.5, 1.5)
    before = norm_weights(model)
    with pytest.raises(KeyError, match="inside"):
        with aqn.noise(model, 0.1, final_norm=True):
            assert not torch.equal(model.norm.weight, before["norm"])
            raise KeyError("inside")
    assert all(torch.equal(before[n], w) for n, w in norm_weights(model).items())
    with aqn.noise(model, 0.0) as info:  # stage 0: nothing changes, but the norms were found
        assert info.modified == 0 and len(info.names) == 4
        assert all(torch.equal(before[n], w) for n, w in norm_weights(model).items())
    for bad in (-1e-3, float("nan"), float("inf")):  # NaN would add nothing silently, inf wipe the norms
        with pytest.raises(ValueError, match="finite number >= 0"):
            with aqn.noise(model, bad):
                pass
    assert all(torch.equal(before[n], w) for n, w in norm_weights(model).items())


def test_noise_in_an_update_pass_with_checkpointing():
    # The flag that also noises the update: forward and backward inside the block, with gradient
    # checkpointing (backward recomputes the forward: it must see the same noisy weights).
    torch.manual_seed(3)
    model = Transformer(small_config()).train()
    model.gradient_checkpointing = True
    tok = torch.randint(0, 53, (2, 8))
    grads = []
    for ckpt in (True, False):
        model.gradient_checkpointing = ckpt
        model.zero_grad()
        with aqn.noise(model, 0.05, generator=torch.Generator().manual_seed(4)):
            model(tok).square().mean().backward()
        grads.append(model.lm_head.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])
    model.zero_grad()
    model(tok).square().mean().backward()
    assert not torch.allclose(model.lm_head.weight.grad, grads[0])  # the noise was in the gradient


def test_noise_statistics_and_seeding():
    model = Transformer(small_config(hidden=512, layers=3))  # 6 norms x 512 channels
    before = norm_weights(model)
    sigma = 3e-3

    def draw(seed):
        with aqn.noise(model, sigma, generator=torch.Generator().manual_seed(seed)):
            return {n: (w - before[n]).double() for n, w in norm_weights(model).items() if n != "norm"}

    z = draw(0)
    flat = torch.cat(list(z.values()))  # 3072 samples of N(0, sigma^2)
    assert flat.std().item() == pytest.approx(sigma, rel=0.08)
    assert abs(flat.mean().item()) < 4 * sigma / flat.numel() ** 0.5
    # Independent per norm (not one vector shared by all layers), and fresh per draw.
    a, b = z["layers.0.input_layernorm"], z["layers.1.post_attention_layernorm"]
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1].item()) < 0.2
    again, other = draw(0), draw(1)
    assert all(torch.equal(z[n], again[n]) for n in z)
    assert abs(torch.corrcoef(torch.stack([z["layers.0.input_layernorm"], other["layers.0.input_layernorm"]]))[0, 1]) < 0.2


# ---------------------------------------------------------------------------------------------
# Finding the norms by role, not by class (the official hook's bug)
# ---------------------------------------------------------------------------------------------

class ForeignRMSNorm(nn.Module):
    """A stand-in for vLLM's RMSNorm: same role and weight, a class no isinstance check knows."""

    def __init__(self, weight, eps):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.eps = eps

    def forward(self, x):
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).to(x.dtype)


def test_noise_reaches_foreign_norm_classes_and_transformers_models(hf_folder):
    torch.manual_seed(2)
    model = Transformer(small_config()).eval()
    for block in model.layers:
        block.input_layernorm = ForeignRMSNorm(block.input_layernorm.weight.data, 1e-6)
        block.post_attention_layernorm = ForeignRMSNorm(block.post_attention_layernorm.weight.data, 1e-6)
    assert not any(isinstance(m, RMSNorm) for m in model.layers.modules())
    tok = torch.randint(0, 53, (1, 6))
    clean = model(tok)
    with aqn.noise(model, 1e-2, generator=torch.Generator().manual_seed(0)) as info:
        assert info.modified == 4
        assert not torch.equal(model(tok), clean)
    assert torch.equal(model(tok), clean)

    hf, _ = hf_folder(num_hidden_layers=3)
    tok = torch.randint(0, hf.config.vocab_size, (2, 5))
    with torch.no_grad():
        clean = hf(tok).logits
        before = {n: p.clone() for n, p in hf.named_parameters() if "norm" in n}
        with aqn.noise(hf, 1e-2, generator=torch.Generator().manual_seed(0), final_norm=True) as info:
            changed = [n for n, p in hf.named_parameters() if "norm" in n and not torch.equal(p, before[n])]
            assert len(changed) == info.modified == 2 * 3 + 1
            assert (hf(tok).logits - clean).abs().max() > 1e-5
        assert torch.equal(hf(tok).logits, clean)


def test_fails_loudly_when_noise_cannot_reach_the_model():
    with pytest.raises(LookupError, match="no module named"):
        with aqn.noise(nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16)), 1e-2):
            pass
    model = Transformer(small_config(layers=2))
    del model.layers[1].post_attention_layernorm  # one norm missing: 3 found, 4 expected
    with pytest.raises(LookupError, match="expected"):
        with aqn.noise(model, 1e-2):
            pass
    model.layers[1].post_attention_layernorm = nn.Identity()  # the right name, but nothing to perturb
    with pytest.raises(TypeError, match="no 1-D weight"):
        with aqn.noise(model, 1e-2):
            pass
    bf16 = Transformer(small_config(layers=2))
    bf16.layers[0].input_layernorm.weight.data = bf16.layers[0].input_layernorm.weight.data.bfloat16()
    with pytest.raises(TypeError, match="float32"):
        with aqn.noise(bf16, 1e-2):
            pass
    assert bf16.layers[1].input_layernorm.weight.dtype == torch.float32  # nothing was touched


# ---------------------------------------------------------------------------------------------
# Entropy rises with sigma
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def one_thread():
    # Tiny matmuls are slower with 2 threads on a busy 2-core machine than with 1.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def train_tiny(vocab=32, steps=25, seed=0):
    """A 2-layer model trained to be confident on a deterministic sequence (next = prev + 5 mod V):
    low entropy because of learned structure, which channel noise then disturbs."""
    torch.manual_seed(seed)
    model = Transformer(small_config(vocab=vocab))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        seq = (torch.randint(0, vocab, (32, 1), generator=g) + 5 * torch.arange(13)) % vocab  # (32, 13)
        logits = model(seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), seq[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@torch.no_grad()
def sampled_entropy(model, n=64, new_tokens=12, seed=0):
    """Sample n sequences at temperature 1 from one random token each; return the mean entropy (nats)
    of the next-token distribution along the sampled path."""
    g = torch.Generator().manual_seed(seed)
    tok = torch.randint(0, model.config.vocab_size, (n, 1), generator=g)  # (n, 1)
    ents = []
    for _ in range(new_tokens):
        logp = F.log_softmax(model(tok)[:, -1].float(), dim=-1)  # (n, V)
        ents.append(-(logp.exp() * logp).sum(-1))
        tok = torch.cat([tok, torch.multinomial(logp.exp(), 1, generator=g)], dim=1)
    return torch.stack(ents).mean().item()


def test_entropy_of_sampled_text_rises_with_sigma(one_thread):
    model = train_tiny()
    sigmas = [0.0, 0.25, 0.5, 1.0]
    draws = 4  # resampled per "rollout step", as in training
    table = []
    for sigma in sigmas:
        row = []
        for r in range(draws):
            with aqn.noise(model, sigma, generator=torch.Generator().manual_seed(100 + r)):
                row.append(sampled_entropy(model, seed=r))
        table.append(row)
    means = [sum(row) / draws for row in table]
    for lo, hi in zip(means, means[1:]):
        assert hi > 1.05 * lo, (sigmas, means)
    # Not carried by one lucky draw: most draws rise at every step too.
    for lo_row, hi_row in zip(table, table[1:]):
        assert sum(h > l for l, h in zip(lo_row, hi_row)) >= draws - 1, table
