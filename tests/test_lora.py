"""LoRA: the module's math against float64, freezing, gradients reaching A and B (B moves after one
AdamW step, on an fp32 and an NVFP4 base), disable_adapters, PEFT parity both ways on a tiny random
Qwen2 saved with transformers, the merge CLI, the errors for broken adapter folders, and trained RMSNorms
(PEFT's modules_to_save): PEFT parity both ways, load/merge/disable, and their tensors kept in place
through an optimizer step and AQN's noise."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

import fp4_gemm
import lora
import nvfp4
from model import Transformer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = lora.TARGETS


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
    with pytest.raises(ValueError, match="quant must be 'nvfp4' or 'bf16'"):  # a typo must not train bf16
        lora.load_policy(folder, quant="fp4")
    # A subset of targets
    sub = ours(folder)
    lora.apply_lora(sub, targets=("q_proj", "down_proj"))
    assert sorted({n.split(".")[-1] for n in lora.lora_modules(sub)}) == ["down_proj", "q_proj"]


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
# PEFT parity, both directions
# ---------------------------------------------------------------------------------------------

def test_our_adapter_loads_in_peft_with_same_logits(hf_folder, tmp_path):
    from peft import PeftModel

    hf, folder = hf_folder(num_hidden_layers=3)
    model = ours(folder)
    lora.apply_lora(model, rank=6, alpha=9)
    randomize_adapters(model, seed=3)
    out = lora.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=folder)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".adapter")]  # no temp folder left
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert (cfg["peft_type"], cfg["task_type"], cfg["r"], cfg["lora_alpha"], cfg["bias"]) == ("LORA", "CAUSAL_LM", 6, 9, "none")
    assert sorted(cfg["target_modules"]) == sorted(TARGETS) and cfg["fan_in_fan_out"] is False
    with safe_open(os.path.join(out, "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.2.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 7 * 3

    tok = tokens(model.config.vocab_size, B=3, T=13, seed=5)
    with torch.no_grad():
        base = hf(tok).logits
        peft_model = PeftModel.from_pretrained(hf, out).eval()  # injects LoRA into hf in place
        want = peft_model(tok).logits
        got = model(tok)
    assert (got - base).abs().max() > 1e-3  # the adapters matter
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # Saving again replaces the folder atomically.
    randomize_adapters(model, seed=4)
    lora.save_adapter(model, out)
    with safe_open(os.path.join(out, "adapter_model.safetensors"), "pt") as f:
        a = f.get_tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight")
    assert torch.equal(a, model.layers[0].self_attn.q_proj.lora_A.weight)


def test_peft_adapter_loads_in_ours_with_same_logits(hf_folder, tmp_path):
    from peft import LoraConfig, get_peft_model

    hf, folder = hf_folder()
    targets = ["q_proj", "v_proj", "o_proj", "down_proj"]
    peft_model = get_peft_model(hf, LoraConfig(r=5, lora_alpha=15, target_modules=targets, lora_dropout=0.0,
                                               task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    peft_model.eval()
    peft_model.save_pretrained(tmp_path / "peft")
    tok = tokens(hf.config.vocab_size, B=2, T=10, seed=8)
    with torch.no_grad():
        want = peft_model(tok).logits

    model = ours(folder)  # no adapters yet: load_adapter applies LoRA with the folder's r/alpha/targets
    params = lora.load_adapter(model, tmp_path / "peft")
    mods = lora.lora_modules(model)
    assert {n.split(".")[-1] for n in mods} == set(targets) and len(mods) == 4 * 2
    assert all(m.rank == 5 and m.scaling == 3 for m in mods.values())
    assert len(params) == 2 * len(mods) and all(p.requires_grad for p in params)
    torch.testing.assert_close(model(tok), want, rtol=0, atol=1e-5)

    # Loading into a model that already has matching adapters only copies the weights.
    model2 = ours(folder)
    lora.apply_lora(model2, rank=5, alpha=15, targets=targets)
    lora.load_adapter(model2, tmp_path / "peft")
    torch.testing.assert_close(model2(tok), want, rtol=0, atol=1e-5)
    # … and mismatched adapters are refused.
    model3 = ours(folder)
    lora.apply_lora(model3, rank=4, alpha=15, targets=targets)
    with pytest.raises(ValueError, match="r=4"):
        lora.load_adapter(model3, tmp_path / "peft")
    model4 = ours(folder)
    lora.apply_lora(model4, rank=5, alpha=15)  # all seven targets: four have no weights in the folder
    with pytest.raises(KeyError, match="do not match"):
        lora.load_adapter(model4, tmp_path / "peft")


# ---------------------------------------------------------------------------------------------
# Merge CLI
# ---------------------------------------------------------------------------------------------

def test_merge_cli_matches_unmerged_model(hf_folder, tmp_path):
    _, folder = hf_folder(tie_word_embeddings=True, max_shard_size="60KB")
    assert os.path.exists(os.path.join(folder, "model.safetensors.index.json"))  # sharded source
    open(os.path.join(folder, "tokenizer_config.json"), "w").write('{"model_max_length": 64}')
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=12, targets=("q_proj", "k_proj", "gate_proj", "down_proj"))
    randomize_adapters(model, seed=9)
    adapter = lora.save_adapter(model, tmp_path / "adapter")
    tok = tokens(model.config.vocab_size, B=2, T=12, seed=10)
    want = model(tok)

    dst = tmp_path / "merged32"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "lora.py"), "--merge", "--model", folder, "--adapter",
                        adapter, "--out", str(dst), "--dtype", "float32"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    # a missing adapter: one line, and it stops before touching the output just written (checked below)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "lora.py"), "--merge", "--model", folder, "--adapter",
                        str(tmp_path / "none"), "--out", str(dst)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip() == f"lora.py: no adapter folder at {str(tmp_path / 'none')!r}"
    assert os.path.exists(dst / "tokenizer_config.json")
    merged = ours(str(dst))
    assert not lora.lora_modules(merged)
    torch.testing.assert_close(merged(tok), want, rtol=0, atol=1e-5)

    # The default export is bf16, and loads (with bf16 rounding of the weights).
    index = json.load(open(dst / "model.safetensors.index.json"))["weight_map"]
    assert len(set(index.values())) > 1 and all(os.path.exists(dst / s) for s in index.values())
    lora.merge(folder, adapter, str(tmp_path / "merged16"))
    for shard in set(index.values()):
        with safe_open(str(tmp_path / "merged16" / shard), "pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    cfg = json.load(open(tmp_path / "merged16" / "config.json"))
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"
    merged16 = ours(str(tmp_path / "merged16"))
    assert (merged16(tok) - want).abs().max() < 0.05


def test_merge_from_nvfp4_base(hf_folder, tmp_path):
    _, folder = hf_folder()
    qdir = str(tmp_path / "q")
    nvfp4.save_quantized(folder, qdir, progress=False)
    model = ours(qdir)
    assert isinstance(model.layers[1].self_attn.v_proj, fp4_gemm.QuantLinear)
    lora.apply_lora(model, rank=3, alpha=3)
    randomize_adapters(model, seed=11)
    adapter = lora.save_adapter(model, tmp_path / "adapter")
    tok = tokens(model.config.vocab_size, seed=12)
    dst = lora.merge(qdir, adapter, str(tmp_path / "merged"), dtype=torch.float32)
    cfg = json.load(open(os.path.join(dst, "config.json")))
    assert "quantization_config" not in cfg
    merged = ours(dst)
    assert isinstance(merged.layers[1].self_attn.v_proj, nn.Linear)
    torch.testing.assert_close(merged(tok), model(tok), rtol=0, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------

def test_clear_errors_for_broken_adapter_folders(hf_folder, tmp_path):
    _, folder = hf_folder()
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=4)
    good = lora.save_adapter(model, tmp_path / "good")
    cfg = json.load(open(os.path.join(good, "adapter_config.json")))
    with safe_open(os.path.join(good, "adapter_model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}

    def folder_with(name, config=cfg, weights=tensors, raw_config=None):
        d = tmp_path / name
        d.mkdir()
        if raw_config is not None:
            (d / "adapter_config.json").write_text(raw_config)
        elif config is not None:
            (d / "adapter_config.json").write_text(json.dumps(config))
        if weights is not None:
            save_file(weights, str(d / "adapter_model.safetensors"))
        return d

    fresh = lambda: ours(folder)
    with pytest.raises(FileNotFoundError, match="no adapter folder"):
        lora.load_adapter(fresh(), tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load_adapter(fresh(), folder_with("noconfig", config=None))
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        lora.load_adapter(fresh(), folder_with("noweights", weights=None))
    d = folder_with("binonly", weights=None)
    (d / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="pickle"):
        lora.load_adapter(fresh(), d)
    with pytest.raises(ValueError, match="not valid JSON"):
        lora.load_adapter(fresh(), folder_with("badjson", raw_config="{r: 4"))
    with pytest.raises(ValueError, match="peft_type"):
        lora.load_adapter(fresh(), folder_with("ia3", config={**cfg, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="use_dora"):
        lora.load_adapter(fresh(), folder_with("dora", config={**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="rank r=8"):
        lora.load_adapter(fresh(), folder_with("rank", config={**cfg, "r": 8}))
    with pytest.raises(ValueError, match="unexpected tensor"):
        lora.load_adapter(fresh(), folder_with("extra", weights={**tensors, "foo.weight": torch.zeros(2)}))
    half = {k: v for k, v in tensors.items() if not k.endswith("layers.1.mlp.up_proj.lora_B.weight")}
    with pytest.raises(ValueError, match="not both"):
        lora.load_adapter(fresh(), folder_with("half", weights=half))
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    with pytest.raises(KeyError, match="lacks"):
        lora.load_adapter(fresh(), folder_with("otherarch", weights=renamed))
    (tmp_path / "bad_st").mkdir()
    (tmp_path / "bad_st" / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp_path / "bad_st" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        lora.load_adapter(fresh(), tmp_path / "bad_st")
    # save_adapter refuses to replace a folder that is not an adapter.
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        lora.save_adapter(model, tmp_path / "precious")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="no LoRA"):
        lora.save_adapter(fresh(), tmp_path / "none")


# ---------------------------------------------------------------------------------------------
# Trained norms (PEFT's modules_to_save)
# ---------------------------------------------------------------------------------------------

def randomize_norms(model, seed=2, std=0.1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in lora.trained_norms(model).values():
            w.add_(torch.randn(w.shape, generator=g) * std)


def test_trained_norms_load_in_peft_and_back_with_same_logits(hf_folder, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    hf, folder = hf_folder(num_hidden_layers=3)
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=8)
    norms = lora.train_norms(model)
    assert len(norms) == 2 * 3 and all(p.requires_grad and p.dtype == torch.float32 for p in norms)
    assert not model.norm.weight.requires_grad and not model.embed_tokens.weight.requires_grad  # the final norm stays
    randomize_adapters(model, seed=3)
    randomize_norms(model, seed=4)
    out = lora.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=folder)
    cfg = json.load(open(os.path.join(out, "adapter_config.json")))
    assert cfg["modules_to_save"] == ["input_layernorm", "post_attention_layernorm"]
    with safe_open(os.path.join(out, "adapter_model.safetensors"), "pt") as f:
        keys = set(f.keys())
        saved = f.get_tensor("base_model.model.model.layers.1.post_attention_layernorm.weight")
    assert len(keys) == 2 * 7 * 3 + 2 * 3
    assert torch.equal(saved, model.layers[1].post_attention_layernorm.weight)

    tok = tokens(model.config.vocab_size, B=3, T=11, seed=5)
    with torch.no_grad():
        got = model(tok)
        with lora.disable_adapters(model):  # the base: adapters off and the norms at their base values
            base_ours = model(tok)
        after = model(tok)
        base = hf(tok).logits
        want = PeftModel.from_pretrained(hf, out).eval()(tok).logits  # PEFT reads our modules_to_save
    torch.testing.assert_close(base_ours, base, rtol=0, atol=1e-5)
    assert torch.equal(after, got)  # disable_adapters put the trained norms back
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)

    # load_adapter brings both back, on a fresh model and on one prepared as train.py prepares it.
    fresh = ours(folder)
    loaded = lora.load_adapter(fresh, out)
    assert len(loaded) == 2 * 7 * 3 + 2 * 3 and lora.trained_norms(fresh)
    torch.testing.assert_close(fresh(tok), got, rtol=0, atol=0)
    prepared = ours(folder)
    lora.apply_lora(prepared, rank=4, alpha=8)
    ptrs = [p.data_ptr() for p in lora.train_norms(prepared)]
    lora.load_adapter(prepared, out)
    assert [p.data_ptr() for p in lora.trained_norms(prepared).values()] == ptrs  # loaded in place
    torch.testing.assert_close(prepared(tok), got, rtol=0, atol=0)
    lora.save_adapter(fresh, tmp_path / "again")  # what load_adapter read, it saves again

    # A PEFT adapter with modules_to_save loads into ours with PEFT's logits.
    hf2, _ = hf_folder(num_hidden_layers=3)
    peft_model = get_peft_model(hf2, LoraConfig(r=4, lora_alpha=4, target_modules=list(TARGETS),
                                                modules_to_save=list(lora.NORMS), task_type="CAUSAL_LM"))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if p.requires_grad:
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
    peft_model.eval().save_pretrained(tmp_path / "peft")
    theirs = ours(folder)
    lora.load_adapter(theirs, tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(theirs(tok), peft_model(tok).logits, rtol=0, atol=1e-5)


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


def test_merge_writes_the_trained_norms(hf_folder, tmp_path):
    _, folder = hf_folder()
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=8, targets=("q_proj", "down_proj"))
    lora.train_norms(model)
    randomize_adapters(model, seed=5)
    randomize_norms(model, seed=6)
    adapter = lora.save_adapter(model, tmp_path / "adapter")
    merged = ours(lora.merge(folder, adapter, str(tmp_path / "merged"), dtype=torch.float32))
    tok = tokens(model.config.vocab_size, B=2, T=8, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(merged(tok), model(tok), rtol=0, atol=1e-5)


def test_trained_norm_folders_are_checked(hf_folder, tmp_path):
    _, folder = hf_folder()
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=8)
    plain = lora.save_adapter(model, tmp_path / "plain")
    lora.train_norms(model)
    with pytest.raises(KeyError, match="trains its norms"):
        lora.load_adapter(model, plain)
    normed = lora.save_adapter(model, tmp_path / "normed")
    cfg = json.load(open(os.path.join(normed, "adapter_config.json")))
    json.dump({**cfg, "modules_to_save": ["lm_head"]}, open(os.path.join(normed, "adapter_config.json"), "w"))
    with pytest.raises(ValueError, match="modules_to_save"):
        lora.read_adapter(normed)
    json.dump({**cfg, "modules_to_save": ["input_layernorm"]}, open(os.path.join(normed, "adapter_config.json"), "w"))
    with pytest.raises(ValueError, match="unexpected tensor"):  # post_attention_layernorm's weights are not listed
        lora.read_adapter(normed)
