"""LoRA: the module's math against float64, freezing and the targets apply_lora picks, gradients reaching A
and B (B moves after one AdamW step, on an fp32 and an NVFP4 base), disable_adapters, and trained RMSNorms
kept in place through an optimizer step and AQN's noise. (The adapter files, PEFT parity and merge:
tests/test_adapters.py.)"""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fp4_gemm
import lora
from lora_ref import ours, randomize_adapters, tokens

TARGETS = lora.TARGETS


# ---------------------------------------------------------------------------------------------
# The module
# ---------------------------------------------------------------------------------------------

def test_lora_linear_matches_float64_reference():
    torch.manual_seed(0)
    base = nn.Linear(48, 80, bias=True)  # odd out size, rank 3, alpha not a multiple of r
    m = lora.LoRALinear(base, rank=3, alpha=7)
    assert m.scaling == pytest.approx(7 / 3)
    assert not base.weight.requires_grad and not base.bias.requires_grad
    assert m.lora_A.weight.requires_grad and m.lora_B.weight.requires_grad
    assert m.lora_A.bias is None and m.lora_B.bias is None
    # PEFT's init: B = 0, A ~ U(-1/sqrt(K), 1/sqrt(K)) (kaiming_uniform_ with a = sqrt(5)).
    assert torch.equal(m.lora_B.weight, torch.zeros(80, 3))
    bound = 1 / math.sqrt(48)
    assert m.lora_A.weight.abs().max() <= bound and m.lora_A.weight.abs().max() > 0.8 * bound
    x = torch.randn(5, 3, 48)
    assert torch.equal(m(x), base(x))  # B = 0: exactly the base
    with torch.no_grad():
        m.lora_B.weight.normal_()
    ref = (x.double() @ base.weight.double().T + base.bias.double()
           + (x.double() @ m.lora_A.weight.double().T) @ m.lora_B.weight.double().T * 7 / 3)
    torch.testing.assert_close(m(x).double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.delta_weight().double(), m.lora_B.weight.double() @ m.lora_A.weight.double() * 7 / 3)


def test_bf16_adapters_on_bf16_base_and_dropout():
    torch.manual_seed(1)
    base = nn.Linear(32, 24, bias=False, dtype=torch.bfloat16)
    m = lora.LoRALinear(base, rank=4, alpha=8, dtype=torch.bfloat16)
    assert m.lora_A.weight.dtype == torch.bfloat16
    with torch.no_grad():
        m.lora_B.weight.normal_()
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    y = m(x)
    assert y.dtype == torch.bfloat16
    ref = base.weight.double() + 2 * m.lora_B.weight.double() @ m.lora_A.weight.double()
    torch.testing.assert_close(y.double(), x.double() @ ref.T, rtol=3e-2, atol=3e-2)
    # fp32 adapters on a bf16 input: the branch runs in bf16 (no fp32 copy of any activation, forward
    # or backward), the fp32 adapters get fp32 gradients that match float64 to bf16 rounding.
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sizes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            outs = out if isinstance(out, (tuple, list)) else [out]
            self.fp32 = max([getattr(self, "fp32", 0)] + [t.numel() for t in outs if isinstance(t, torch.Tensor)
                                                          and t.dtype == torch.float32])
            return out

    m32 = lora.LoRALinear(base, rank=4, alpha=8, dtype=torch.float32)
    with torch.no_grad():
        m32.lora_B.weight.normal_()
    xg = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    with Sizes() as sizes:
        y32 = m32(xg)
        y32.float().pow(2).sum().backward()
    assert y32.dtype == torch.bfloat16 and m32.lora_A.weight.grad.dtype == torch.float32
    assert sizes.fp32 < xg.numel(), "an activation-sized float32 tensor was made"  # (y32.float(): 64 x 24)

    class Outputs(TorchDispatchMode):  # the storages of output-sized tensors the forward makes
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.numel() == 64 * 24:
                self.ptrs = getattr(self, "ptrs", set()) | {out.untyped_storage().data_ptr()}
            return out

    with Outputs() as outputs:
        m32(xg)
    assert len(outputs.ptrs) == 1, "the LoRA branch copied the base output instead of adding into it"
    A, B, W, xd = (t.detach().double() for t in (m32.lora_A.weight, m32.lora_B.weight, base.weight, xg))
    yd = xd @ W.T + 2 * (xd @ A.T) @ B.T
    gA = 2 * (B.T @ (2 * yd).T) @ xd  # dL/dA for L = sum(y^2): scaling * B^T dY^T x
    torch.testing.assert_close(m32.lora_A.weight.grad.double(), gA, rtol=5e-2, atol=5e-2 * gA.abs().max().item())
    # Dropout acts on the LoRA branch only, and only in training mode.
    md = lora.LoRALinear(nn.Linear(32, 24), rank=4, alpha=4, dropout=0.5)
    with torch.no_grad():
        md.lora_B.weight.normal_()
    xf = torch.randn(6, 32)
    md.eval()
    assert torch.equal(md(xf), md(xf))
    md.train()
    assert not torch.equal(md(xf), md(xf))


def test_apply_lora_wraps_targets_and_freezes_everything_else(hf_folder):
    _, folder = hf_folder(num_hidden_layers=3)
    model = ours(folder)
    params = lora.apply_lora(model, rank=5, alpha=10)
    mods = lora.lora_modules(model)
    assert len(mods) == 7 * 3
    assert {n.split(".")[-1] for n in mods} == set(TARGETS)
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, lora.LoRALinear)
    expect = [p for m in mods.values() for p in (m.lora_A.weight, m.lora_B.weight)]
    assert len(params) == len(expect) and all(a is b for a, b in zip(params, expect))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert not model.embed_tokens.weight.requires_grad and not model.norm.weight.requires_grad
    assert not model.layers[0].self_attn.q_proj.base.bias.requires_grad  # Qwen2's q/k/v biases
    with pytest.raises(ValueError, match="already has LoRA"):
        lora.apply_lora(model)
    with pytest.raises(ValueError, match="matched no linear"):
        lora.apply_lora(ours(folder), targets=("nope",))
    normed = ours(folder)  # the other order would freeze the norms that train_norms made trainable
    lora.train_norms(normed)
    with pytest.raises(ValueError, match="call train_norms after apply_lora"):
        lora.apply_lora(normed)
    assert all(w.requires_grad for w in lora.trained_norms(normed).values())
    # A subset of targets, and targets named as PEFT's target_modules are: the end of a module's dotted name
    sub = ours(folder)
    lora.apply_lora(sub, targets=("q_proj", "down_proj"))
    assert sorted({n.split(".")[-1] for n in lora.lora_modules(sub)}) == ["down_proj", "q_proj"]
    one = ours(folder)
    lora.apply_lora(one, targets=("layers.1.mlp.down_proj", "self_attn.v_proj"))
    assert sorted(lora.lora_modules(one)) == ["layers.0.self_attn.v_proj", "layers.1.mlp.down_proj",
                                              "layers.1.self_attn.v_proj", "layers.2.self_attn.v_proj"]
    assert not lora.targeted("layers.1.mlp.down_proj", ["n_proj", "mlp.down", "layers.1"])  # whole names only


# ---------------------------------------------------------------------------------------------
# Training signal, base equality, reference policy
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("quantized", [False, True], ids=["fp32-base", "nvfp4-base"])
def test_gradients_reach_adapters_and_b_moves(hf_folder, quantized):
    _, folder = hf_folder()
    model = ours(folder)
    if quantized:
        fp4_gemm.quantize_model(model)
        assert isinstance(model.layers[0].mlp.up_proj, fp4_gemm.QuantLinear)
    tok = tokens(model.config.vocab_size, B=3, T=9)
    base_logits = model(tok)
    params = lora.apply_lora(model, rank=4, alpha=8)
    mods = lora.lora_modules(model)
    if quantized:
        assert all(isinstance(m.base, fp4_gemm.QuantLinear) for m in mods.values())
    assert torch.equal(model(tok), base_logits)  # B = 0 → exactly the base model
    opt = torch.optim.AdamW(params, lr=1e-2)
    model.train()

    def step():
        opt.zero_grad()
        logits = model(tok[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tok[:, 1:].reshape(-1))
        loss.backward()

    step()
    for name, m in mods.items():
        # With B = 0 the gradient reaches B only (dL/dA = B^T · … = 0): B must move first.
        assert m.lora_B.weight.grad is not None and m.lora_B.weight.grad.abs().sum() > 0, name
        assert torch.equal(m.lora_A.weight.grad, torch.zeros_like(m.lora_A.weight)), name
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert p.grad is None, n
    before = {n: (m.lora_A.weight.detach().clone(), m.lora_B.weight.detach().clone()) for n, m in mods.items()}
    opt.step()
    for name, m in mods.items():
        assert not torch.equal(m.lora_B.weight, before[name][1]), f"{name}: LoRA B did not move"
    step()  # now B != 0, so A gets a gradient too
    for name, m in mods.items():
        assert m.lora_A.weight.grad.abs().sum() > 0, name
    opt.step()
    for name, m in mods.items():
        assert not torch.equal(m.lora_A.weight, before[name][0]), f"{name}: LoRA A did not move"
    model.eval()
    assert not torch.allclose(model(tok), base_logits)


def test_disable_adapters_gives_base_and_is_exception_safe(hf_folder):
    _, folder = hf_folder()
    model = ours(folder)
    tok = tokens(model.config.vocab_size, T=11)
    base_logits = model(tok)
    lora.apply_lora(model, rank=3, alpha=6)
    randomize_adapters(model)
    tuned = model(tok)
    assert (tuned - base_logits).abs().max() > 1e-3
    with lora.disable_adapters(model):
        assert torch.equal(model(tok), base_logits)
        with lora.disable_adapters(model):  # nested
            assert torch.equal(model(tok), base_logits)
        assert torch.equal(model(tok), base_logits)
    assert torch.equal(model(tok), tuned)
    with pytest.raises(RuntimeError, match="boom"):
        with lora.disable_adapters(model):
            raise RuntimeError("boom")
    assert torch.equal(model(tok), tuned)


# ---------------------------------------------------------------------------------------------
# Trained norms
# ---------------------------------------------------------------------------------------------

def test_norm_updates_and_aqn_noise_keep_the_tensors_in_place(hf_folder):
    import aqn

    _, folder = hf_folder()
    model = ours(folder)
    params = lora.apply_lora(model, rank=4, alpha=8)
    norms = lora.train_norms(model)
    ptrs = [p.data_ptr() for p in norms]
    before = [p.detach().clone() for p in norms]
    tok = tokens(model.config.vocab_size, B=2, T=9, seed=1)
    for foreach in (False, True):
        opt = torch.optim.AdamW([{"params": params}, {"params": norms, "weight_decay": 0.0}], lr=1e-2,
                                weight_decay=0.1, foreach=foreach)
        model(tok).float().logsumexp(-1).mean().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in norms)
        opt.step()
        opt.zero_grad(set_to_none=True)
    assert [p.data_ptr() for p in norms] == ptrs  # the decoder's CUDA graphs read these addresses
    assert all(not torch.equal(p, b) for p, b in zip(norms, before))
    trained = [p.detach().clone() for p in norms]
    with aqn.noise(model, 1e-2, torch.Generator().manual_seed(0)):  # noise on the CURRENT (trained) values
        assert all(not torch.equal(p, t) for p, t in zip(norms, trained))
        assert [p.data_ptr() for p in norms] == ptrs
    assert all(torch.equal(p, t) for p, t in zip(norms, trained))  # restored bit for bit
