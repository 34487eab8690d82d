"""adapters.py: PEFT parity both ways on a tiny random Qwen2 saved with transformers (LoRA, and trained
RMSNorms as PEFT's modules_to_save), the merge CLI from bf16 and NVFP4 bases, clear errors for broken,
damaged and non-finite adapter folders (argv or file → one line naming the file; the output folder the same
before and after), a full disk during a merge (a faked safetensors error, and a real small filesystem where
the test can mount one), and load_policy's checks."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import adapters
import fp4_gemm
import hub
import lora
import nvfp4
from lora_ref import ours, randomize_adapters, randomize_norms, tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = lora.TARGETS


# ---------------------------------------------------------------------------------------------
# PEFT parity, both directions
# ---------------------------------------------------------------------------------------------

def test_our_adapter_loads_in_peft_with_same_logits(hf_folder, tmp_path):
    from peft import PeftModel

    hf, folder = hf_folder(num_hidden_layers=3)
    model = ours(folder)
    lora.apply_lora(model, rank=6, alpha=9)
    randomize_adapters(model, seed=3)
    out = adapters.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=folder)
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
    adapters.save_adapter(model, out)
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
    params = adapters.load_adapter(model, tmp_path / "peft")
    mods = lora.lora_modules(model)
    assert {n.split(".")[-1] for n in mods} == set(targets) and len(mods) == 4 * 2
    assert all(m.rank == 5 and m.scaling == 3 for m in mods.values())
    assert len(params) == 2 * len(mods) and all(p.requires_grad for p in params)
    torch.testing.assert_close(model(tok), want, rtol=0, atol=1e-5)

    # Loading into a model that already has matching adapters only copies the weights.
    model2 = ours(folder)
    lora.apply_lora(model2, rank=5, alpha=15, targets=targets)
    adapters.load_adapter(model2, tmp_path / "peft")
    torch.testing.assert_close(model2(tok), want, rtol=0, atol=1e-5)
    # … and mismatched adapters are refused.
    model3 = ours(folder)
    lora.apply_lora(model3, rank=4, alpha=15, targets=targets)
    with pytest.raises(ValueError, match="r=4"):
        adapters.load_adapter(model3, tmp_path / "peft")
    model4 = ours(folder)
    lora.apply_lora(model4, rank=5, alpha=15)  # all seven targets: four have no weights in the folder
    with pytest.raises(KeyError, match="do not match"):
        adapters.load_adapter(model4, tmp_path / "peft")


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
    adapter = adapters.save_adapter(model, tmp_path / "adapter")
    tok = tokens(model.config.vocab_size, B=2, T=12, seed=10)
    want = model(tok)

    dst = tmp_path / "merged32"
    r = subprocess.run([sys.executable, os.path.join(ROOT, "adapters.py"), "--merge", "--model", folder, "--adapter",
                        adapter, "--out", str(dst), "--dtype", "float32"], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    # a missing adapter: one line, and it stops before touching the output just written (checked below)
    r = subprocess.run([sys.executable, os.path.join(ROOT, "adapters.py"), "--merge", "--model", folder, "--adapter",
                        str(tmp_path / "none"), "--out", str(dst)], capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 1 and r.stderr.strip() == f"adapters.py: no adapter folder at {str(tmp_path / 'none')!r}"
    assert os.path.exists(dst / "tokenizer_config.json")
    merged = ours(str(dst))
    assert not lora.lora_modules(merged)
    torch.testing.assert_close(merged(tok), want, rtol=0, atol=1e-5)

    # The default export is bf16, and loads (with bf16 rounding of the weights).
    index = json.load(open(dst / "model.safetensors.index.json"))["weight_map"]
    assert len(set(index.values())) > 1 and all(os.path.exists(dst / s) for s in index.values())
    adapters.merge(folder, adapter, str(tmp_path / "merged16"))
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
    adapter = adapters.save_adapter(model, tmp_path / "adapter")
    tok = tokens(model.config.vocab_size, seed=12)
    dst = adapters.merge(qdir, adapter, str(tmp_path / "merged"), dtype=torch.float32)
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
    good = adapters.save_adapter(model, tmp_path / "good")
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
        adapters.load_adapter(fresh(), tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        adapters.load_adapter(fresh(), folder_with("noconfig", config=None))
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        adapters.load_adapter(fresh(), folder_with("noweights", weights=None))
    d = folder_with("binonly", weights=None)
    (d / "adapter_model.bin").write_bytes(b"x")
    with pytest.raises(FileNotFoundError, match="pickle"):
        adapters.load_adapter(fresh(), d)
    with pytest.raises(ValueError, match="not valid JSON"):
        adapters.load_adapter(fresh(), folder_with("badjson", raw_config="{r: 4"))
    with pytest.raises(ValueError, match="peft_type"):
        adapters.load_adapter(fresh(), folder_with("ia3", config={**cfg, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match="use_dora"):
        adapters.load_adapter(fresh(), folder_with("dora", config={**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="rank r=8"):
        adapters.load_adapter(fresh(), folder_with("rank", config={**cfg, "r": 8}))
    with pytest.raises(ValueError, match="unexpected tensor"):
        adapters.load_adapter(fresh(), folder_with("extra", weights={**tensors, "foo.weight": torch.zeros(2)}))
    half = {k: v for k, v in tensors.items() if not k.endswith("layers.1.mlp.up_proj.lora_B.weight")}
    with pytest.raises(ValueError, match="not both"):
        adapters.load_adapter(fresh(), folder_with("half", weights=half))
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    with pytest.raises(KeyError, match="lacks"):
        adapters.load_adapter(fresh(), folder_with("otherarch", weights=renamed))
    (tmp_path / "bad_st").mkdir()
    (tmp_path / "bad_st" / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp_path / "bad_st" / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="safetensors"):
        adapters.load_adapter(fresh(), tmp_path / "bad_st")
    # save_adapter refuses to replace a folder that is not an adapter.
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        adapters.save_adapter(model, tmp_path / "precious")
    assert (tmp_path / "precious" / "notes.txt").read_text() == "keep me"
    with pytest.raises(ValueError, match="no LoRA"):
        adapters.save_adapter(fresh(), tmp_path / "none")


# ---------------------------------------------------------------------------------------------
# Trained norms (PEFT's modules_to_save)
# ---------------------------------------------------------------------------------------------

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
    out = adapters.save_adapter(model, tmp_path / "adapter", base_model_name_or_path=folder)
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
    loaded = adapters.load_adapter(fresh, out)
    assert len(loaded) == 2 * 7 * 3 + 2 * 3 and lora.trained_norms(fresh)
    torch.testing.assert_close(fresh(tok), got, rtol=0, atol=0)
    prepared = ours(folder)
    lora.apply_lora(prepared, rank=4, alpha=8)
    ptrs = [p.data_ptr() for p in lora.train_norms(prepared)]
    adapters.load_adapter(prepared, out)
    assert [p.data_ptr() for p in lora.trained_norms(prepared).values()] == ptrs  # loaded in place
    torch.testing.assert_close(prepared(tok), got, rtol=0, atol=0)
    adapters.save_adapter(fresh, tmp_path / "again")  # what load_adapter read, it saves again

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
    adapters.load_adapter(theirs, tmp_path / "peft")
    with torch.no_grad():
        torch.testing.assert_close(theirs(tok), peft_model(tok).logits, rtol=0, atol=1e-5)


def test_merge_writes_the_trained_norms(hf_folder, tmp_path):
    _, folder = hf_folder()
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=8, targets=("q_proj", "down_proj"))
    lora.train_norms(model)
    randomize_adapters(model, seed=5)
    randomize_norms(model, seed=6)
    adapter = adapters.save_adapter(model, tmp_path / "adapter")
    merged = ours(adapters.merge(folder, adapter, str(tmp_path / "merged"), dtype=torch.float32))
    tok = tokens(model.config.vocab_size, B=2, T=8, seed=7)
    with torch.no_grad():
        torch.testing.assert_close(merged(tok), model(tok), rtol=0, atol=1e-5)


def test_trained_norm_folders_are_checked(hf_folder, tmp_path):
    _, folder = hf_folder()
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=8)
    plain = adapters.save_adapter(model, tmp_path / "plain")
    lora.train_norms(model)
    with pytest.raises(KeyError, match="trains its norms"):
        adapters.load_adapter(model, plain)
    normed = adapters.save_adapter(model, tmp_path / "normed")
    cfg = json.load(open(os.path.join(normed, "adapter_config.json")))
    json.dump({**cfg, "modules_to_save": ["lm_head"]}, open(os.path.join(normed, "adapter_config.json"), "w"))
    with pytest.raises(ValueError, match="modules_to_save"):
        adapters.read_adapter(normed)
    json.dump({**cfg, "modules_to_save": ["input_layernorm"]}, open(os.path.join(normed, "adapter_config.json"), "w"))
    with pytest.raises(ValueError, match="unexpected tensor"):  # post_attention_layernorm's weights are not listed
        adapters.read_adapter(normed)


def test_load_policy_refuses_an_unknown_quantization(hf_folder):
    _, folder = hf_folder()
    with pytest.raises(ValueError, match="quant must be 'nvfp4' or 'bf16'"):  # a typo must not train bf16
        adapters.load_policy(folder, quant="fp4")


# ---------------------------------------------------------------------------------------------
# Non-finite and damaged adapters: refused on every read, naming the file
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def good_adapter(hf_folder, tmp_path):
    """(base folder, adapter folder with trained norms, its config, its tensors) on a tiny random Qwen2."""
    _, folder = hf_folder()
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=8)
    lora.train_norms(model)
    randomize_adapters(model, seed=2)
    good = adapters.save_adapter(model, tmp_path / "good")
    with safe_open(os.path.join(good, adapters.WEIGHTS_NAME), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return folder, good, json.load(open(os.path.join(good, adapters.CONFIG_NAME))), tensors


def damaged(tmp_path, name, cfg, tensors):
    d = tmp_path / name
    d.mkdir()
    (d / adapters.CONFIG_NAME).write_text(json.dumps(cfg))  # (json writes NaN and Infinity as such)
    save_file(tensors, str(d / adapters.WEIGHTS_NAME))
    return str(d)


A0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
B1 = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
NORM = "base_model.model.model.layers.1.input_layernorm.weight"


def nan_at(t, i=0):
    t = t.clone()
    t.view(-1)[i] = float("nan")
    return t


CONFIG, WEIGHTS = adapters.CONFIG_NAME, adapters.WEIGHTS_NAME
# (name, change to the config, change to the tensors, file the message names, fragment of the message)
DAMAGE = [
    ("alpha-nan", {"lora_alpha": float("nan")}, {}, CONFIG, "lora_alpha must be a finite number > 0, got nan"),
    ("alpha-inf", {"lora_alpha": float("inf")}, {}, CONFIG, "lora_alpha must be a finite number > 0, got inf"),
    ("alpha-neg", {"lora_alpha": -8}, {}, CONFIG, "lora_alpha must be a finite number > 0, got -8"),
    ("alpha-text", {"lora_alpha": "8"}, {}, CONFIG, "lora_alpha must be a finite number > 0, got '8'"),
    ("r-zero", {"r": 0}, {}, CONFIG, "r must be a positive integer (the LoRA rank), got 0"),
    ("r-float", {"r": 4.0}, {}, CONFIG, "r must be a positive integer (the LoRA rank), got 4.0"),
    ("r-bool", {"r": True}, {}, CONFIG, "r must be a positive integer (the LoRA rank), got True"),
    ("dropout-nan", {"lora_dropout": float("nan")}, {}, CONFIG, "lora_dropout must be a number in [0, 1), got nan"),
    ("a-nan", {}, {A0: nan_at}, WEIGHTS, f"{A0} holds 1 non-finite values (NaN or infinity) of 256"),
    ("b-inf", {}, {B1: lambda t: t.index_fill(0, torch.tensor([3]), float("inf"))}, WEIGHTS,
     f"{B1} holds 4 non-finite values"),
    ("norm-nan", {}, {NORM: lambda t: nan_at(t, 5)}, WEIGHTS, f"{NORM} holds 1 non-finite values"),
    ("a-int", {}, {A0: lambda t: t.to(torch.int32)}, WEIGHTS, f"{A0} has dtype torch.int32"),
    ("norm-2d", {}, {NORM: lambda t: t[None]}, WEIGHTS, f"{NORM} has shape (1, 64), expected (?,)"),
    ("a-3d", {}, {A0: lambda t: t[None]}, WEIGHTS, "lora_A (1, 4, 64) / lora_B (64, 4) do not have rank r=4"),
]


@pytest.mark.parametrize("name,config,change,file,fragment", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_adapters_are_refused_naming_the_file(good_adapter, tmp_path, capsys, name, config, change, file,
                                                      fragment):
    """Each damage is refused by read_adapter (and so by load_adapter, merge, train's resume check) with one
    line naming the file; `adapters.py --merge` stops with that line and leaves --out as it was (absent, or an
    earlier merge intact); eval.py stops with it before the model loads or its output folder is made."""
    folder, good, cfg, tensors = good_adapter
    bad = damaged(tmp_path, name, {**cfg, **config}, {k: change.get(k, lambda t: t)(t) for k, t in tensors.items()})
    where = os.path.join(bad, file)
    with pytest.raises(ValueError) as e:
        adapters.read_adapter(bad)
    assert str(e.value).startswith(f"{where}: ") and fragment in str(e.value), str(e.value)
    with pytest.raises(ValueError, match=re.escape(fragment)):
        adapters.load_adapter(ours(folder), bad)

    out = tmp_path / "merged"
    with pytest.raises(SystemExit) as e:
        adapters.main(["--merge", "--model", folder, "--adapter", bad, "--out", str(out)])
    assert e.value.code == f"adapters.py: {where}: " + str(e.value.code).split(f"{where}: ", 1)[1]
    assert fragment in e.value.code and "\n" not in e.value.code
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    adapters.main(["--merge", "--model", folder, "--adapter", good, "--out", str(out)])  # an earlier merge
    before = tree(out)
    with pytest.raises(SystemExit, match=re.escape(fragment)):
        adapters.main(["--merge", "--model", folder, "--adapter", bad, "--out", str(out)])
    assert tree(out) == before

    import eval as ev

    eval_out = tmp_path / "eval"
    with pytest.raises(SystemExit) as e:
        ev.main(["--model", folder, "--adapter", bad, "--data", "arith", "--limit", "2", "--out", str(eval_out)])
    assert str(e.value.code).startswith(f"eval.py: {where}: ") and fragment in e.value.code, e.value.code
    assert not eval_out.exists()
    capsys.readouterr()


def test_a_merge_of_a_finite_adapter_onto_a_damaged_base_is_refused(good_adapter, tmp_path):
    """merge reads every base tensor through the same check: a NaN in the base is named, nothing is written."""
    folder, good, _, _ = good_adapter
    base = tmp_path / "base"
    shutil.copytree(folder, base)
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        weights = {k: f.get_tensor(k) for k in f.keys()}
    key = "model.layers.1.mlp.up_proj.weight"
    save_file({**weights, key: nan_at(weights[key], 7)}, str(base / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{base}/model.safetensors: {key} holds 1 non-finite values"):
        adapters.merge(str(base), good, str(tmp_path / "merged"))
    assert not (tmp_path / "merged").exists()


def tree(folder):
    """{relative path: file bytes} of every file under folder."""
    return {os.path.relpath(os.path.join(d, n), folder): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(folder) for n in names}


# ---------------------------------------------------------------------------------------------
# A full disk: one line naming the path and what was kept, nothing half-written
# ---------------------------------------------------------------------------------------------

def disk_full(monkeypatch, after=0):
    """safetensors' writer, as adapters.py calls it, failing the way a full disk makes it fail (a
    SafetensorError, no OSError) after `after` successful files, having written part of the file."""
    from safetensors import SafetensorError

    real, calls = adapters.save_file, []

    def save_file_on_a_full_disk(tensors, path, metadata=None):
        calls.append(path)
        if len(calls) > after:
            with open(path, "wb") as f:
                f.write(b"\0" * 100)  # what a write cut short leaves
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, path, metadata=metadata)

    monkeypatch.setattr(adapters, "save_file", save_file_on_a_full_disk)
    return calls


def test_a_full_disk_during_a_merge_keeps_what_was_there(good_adapter, hf_folder, tmp_path, monkeypatch):
    _, sharded = hf_folder(max_shard_size="60KB")
    model = ours(sharded)
    lora.apply_lora(model, rank=4, alpha=8)
    adapter = adapters.save_adapter(model, tmp_path / "adapter-sharded")
    out = tmp_path / "merged"
    calls = disk_full(monkeypatch, after=1)  # the second shard fails: the first is written by then
    with pytest.raises(SystemExit) as e:
        adapters.main(["--merge", "--model", sharded, "--adapter", adapter, "--out", str(out)])
    assert len(calls) == 2 and e.value.code == (f"adapters.py: cannot write {out / os.path.basename(calls[1])}: Error "
                                                f"while serializing: I/O error: No space left on device (os error 28); "
                                                f"nothing was left at {out}")
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    monkeypatch.undo()
    adapters.merge(sharded, adapter, str(out))  # an earlier merge: a failed one replaces nothing of it
    before = tree(out)
    disk_full(monkeypatch, after=0)
    with pytest.raises(hub.OutputError, match=f"No space left on device .*; {out} is left as it was"):
        adapters.merge(sharded, adapter, str(out))
    assert tree(out) == before and not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_a_full_disk_while_saving_an_adapter_keeps_the_old_one(good_adapter, hf_folder, tmp_path, monkeypatch):
    folder, good, _, _ = good_adapter
    model = ours(folder)
    lora.apply_lora(model, rank=4, alpha=8)
    disk_full(monkeypatch)
    with pytest.raises(hub.OutputError, match=f"cannot write {tmp_path}/new/adapter_model.safetensors: .*No space "
                                              f"left on device .*; no adapter was written"):
        adapters.save_adapter(model, tmp_path / "new")
    before = tree(good)
    with pytest.raises(hub.OutputError, match=f"; the adapter at {good} before it is kept"):
        adapters.save_adapter(model, good)
    assert tree(good) == before and not (tmp_path / "new").exists()
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".adapter")]


def test_a_full_disk_on_a_real_small_filesystem(good_adapter, tmp_path):
    """The same on a real filesystem that fills up: a tmpfs mounted in a user namespace (no root needed where
    the kernel allows unprivileged user namespaces), big enough for one merge and not two. The first merge
    is written; the second, which replaces it, fails for lack of space with one line and leaves the first."""
    folder, good, _, _ = good_adapter
    probe = adapters.merge(folder, good, str(tmp_path / "probe"))
    size = sum(len(b) for b in tree(probe).values())
    disk = tmp_path / "disk"
    disk.mkdir()
    kb = (size * 3 // 2) // 1024 + 8
    merge = [sys.executable, os.path.join(ROOT, "adapters.py"), "--merge", "--model", folder, "--adapter", good,
             "--out", f"{disk}/merged"]
    d, run = shlex.quote(str(disk)), shlex.join(merge)
    script = (f"mount -t tmpfs -o size={kb}k tmpfs {d} || exit 90\n"
              f"{run} > /dev/null || exit 91\n"
              f"sha256sum {d}/merged/* > {d}/before.txt\n"
              f"{run} > /dev/null 2> {d}/err.txt; echo rc=$?\n"
              f"cat {d}/err.txt\n"
              f"sha256sum {d}/merged/* | diff - {d}/before.txt && echo same\n"
              f"ls -A {d}\n")
    try:
        r = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
    except FileNotFoundError:
        pytest.skip("no unshare command here to mount a small filesystem without root")
    if r.returncode in (1, 90) and "rc=" not in r.stdout:
        pytest.skip(f"cannot mount a small filesystem here without root (unshare/mount: {r.stderr.strip()[:200]})")
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[0] == "rc=1", r.stdout
    assert lines[1].startswith(f"adapters.py: cannot write {disk}/merged/model.safetensors: ") and \
        "No space left on device" in lines[1] and lines[1].endswith(f"; {disk}/merged is left as it was"), lines[1]
    assert lines[2:] == ["same", "before.txt", "err.txt", "merged"], r.stdout  # no temporary folder left
