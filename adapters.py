"""Adapter files: LoRA and trained norms as PEFT folders, checked on every read; merge; the policy loader.

What training produces is small: LoRA's A (r, K) and B (N, r) for every adapted linear, and, with
trained norms, the blocks' RMSNorm weights (lora.py). This file writes them as the folder PEFT writes,
so that `peft.PeftModel.from_pretrained` on the transformers model loads them and gives our logits, and
reads PEFT's folders back:

    adapter_config.json         peft_type LORA, r, lora_alpha, lora_dropout, target_modules, modules_to_save
    adapter_model.safetensors   base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   (r, K)
                                base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   (N, r)
                                base_model.model.model.layers.0.input_layernorm.weight           (H,)

The key names. Our module `layers.0.self_attn.q_proj` is the HF module `model.layers.0.self_attn.q_proj`
(model.hf_key), and PeftModel wraps the whole HF model once more (`base_model.model.`), giving the names
above (`peft_key`, and its inverse `module_of_key`). A trained norm is stored under its module's own
name: PEFT keeps it in memory as `....input_layernorm.modules_to_save.default.weight` and strips that on
save, puts it back on load. target_modules holds the short names ("q_proj", ...) when the adapters cover
every linear of those names, as apply_lora's do, else the full HF names, which match exactly those
modules (PEFT matches a target against the end of a module's dotted name).

Supported: plain LoRA (uniform r and alpha; no DoRA, rsLoRA, rank/alpha patterns or bias training) and
trained RMSNorm weights as modules_to_save. Anything else is refused with a message rather than loaded
wrongly, and so is a damaged folder: every read (`read_adapter`, under load_adapter, merge, eval.py's and
train.py's checks) checks that r is a positive integer, lora_alpha a finite number > 0 and lora_dropout in
[0, 1); that every tensor is a float tensor of the right rank and shape and holds no NaN or infinity
(hub.check_tensor). A NaN there would otherwise run silently to NaN logits: a merged checkpoint full of
NaN, an evaluation of empty completions.

Merge: `python adapters.py --merge --model BASE --adapter DIR --out DST` writes a plain HF checkpoint
with W + (alpha / r) B A on every adapted linear and the trained norms in place of the base's (NVFP4
bases dequantized first; bf16 by default), streaming one tensor at a time, into a folder written under a
temporary name and renamed when complete (hub.new_folder): a failed write (a full disk) leaves --out as
it was and says so in one line (hub.writing).

load_policy: the base (quantized to NVFP4 as it loads, or not) with an adapter applied: what eval.py
evaluates and train.py trains.
"""
import argparse
import json
import math
import os
import shutil
import tempfile

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import hub
import nvfp4
from lora import LoRALinear, NORMS, apply_lora, lora_modules, norm_modules, train_norms, trained_norms, wrappable
from model import Transformer, hf_key, read_config

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model: peft.base_model.model is the HF model
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what an adapter tensor may be


# ---------------------------------------------------------------------------------------------
# Key names
# ---------------------------------------------------------------------------------------------

def peft_key(module_name, which):
    """'layers.0.self_attn.q_proj', 'A' → 'base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight'."""
    return f"{PEFT_PREFIX}{hf_key(module_name)}.lora_{which}.weight"


def module_of_key(key):
    """The inverse of peft_key: → (our module name, 'A' or 'B'), or None for a non-LoRA key."""
    for which in ("A", "B"):
        suffix = f".lora_{which}.weight"
        if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
            name = key[len(PEFT_PREFIX):-len(suffix)]
            return (name[len("model."):] if name.startswith("model.") else name), which
    return None


# ---------------------------------------------------------------------------------------------
# Writing a folder
# ---------------------------------------------------------------------------------------------

def _uniform(mods, attr):
    values = {getattr(m, attr) for m in mods.values()}
    if len(values) != 1:
        raise ValueError(f"adapters with different {attr}s {sorted(values)} need PEFT's rank/alpha patterns, "
                         f"which this writer does not produce")
    return values.pop()


def save_adapter(model, dir, base_model_name_or_path=None):
    """Write `dir` as a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors).
    The folder is built under a temporary name next to `dir` and renamed into place, so a crash or a full
    disk never leaves half an adapter (a failed write is one OutputError line); an existing adapter folder
    at `dir` is replaced."""
    mods = lora_modules(model)
    if not mods:
        raise ValueError("the model has no LoRA adapters to save")
    rank, alpha = _uniform(mods, "rank"), _uniform(mods, "alpha")
    dropouts = {m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0 for m in mods.values()}
    leaves = sorted({n.split(".")[-1] for n in mods})
    # the short names when our adapters cover every linear of those names (apply_lora's always do), else the
    # full HF module names, which match exactly those modules and no others
    everywhere = {n for n, m in model.named_modules()
                  if n.split(".")[-1] in leaves and (wrappable(m) or isinstance(m, LoRALinear))}
    target_modules = leaves if everywhere == set(mods) else sorted(hf_key(n) for n in mods)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model_name_or_path,
        "r": rank, "lora_alpha": alpha, "lora_dropout": max(dropouts), "target_modules": target_modules,
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "init_lora_weights": True, "inference_mode": True,
        "modules_to_save": list(model.modules_to_save) if trained_norms(model) else None,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
        "revision": None,
    }
    tensors = {}
    for name, m in mods.items():
        tensors[peft_key(name, "A")] = m.lora_A.weight.detach().contiguous().cpu()  # (r, K)
        tensors[peft_key(name, "B")] = m.lora_B.weight.detach().contiguous().cpu()  # (N, r)
    for name, w in trained_norms(model).items():  # PEFT's on-disk modules_to_save key: the module's own
        tensors[f"{PEFT_PREFIX}{hf_key(name)}.weight"] = w.detach().float().contiguous().cpu()  # (H,)
    dir = os.path.abspath(dir)
    if os.path.exists(dir) and os.listdir(dir) and not os.path.exists(os.path.join(dir, CONFIG_NAME)):
        raise FileExistsError(f"{dir} exists and is not an adapter folder; refusing to replace it")
    parent = os.path.dirname(dir)
    os.makedirs(parent, exist_ok=True)
    kept = f"the adapter at {dir} before it is kept" if os.path.exists(dir) else "no adapter was written"
    tmp = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    try:
        hub.normal_permissions(tmp)  # (mkdtemp's 0700 would hide the adapter from other users)
        with hub.writing(os.path.join(dir, WEIGHTS_NAME), kept):
            save_file(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
        with hub.writing(os.path.join(dir, CONFIG_NAME), kept):
            with open(os.path.join(tmp, CONFIG_NAME), "w") as f:
                json.dump(config, f, indent=2)
        old = None
        if os.path.exists(dir):  # move the old one aside first: a rename cannot replace a full folder
            old = tempfile.mkdtemp(prefix=".adapter-old-", dir=parent)
            os.replace(dir, os.path.join(old, "x"))
        os.replace(tmp, dir)
        if old:
            shutil.rmtree(old)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dir


# ---------------------------------------------------------------------------------------------
# Reading a folder, checked
# ---------------------------------------------------------------------------------------------

def _check_config(cfg, cfg_path):
    """Refuse (ValueError naming the file) a config that is not plain LoRA or whose numbers make no sense."""
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type is {cfg.get('peft_type')!r}, only LORA adapters are supported")
    r, alpha, dropout = cfg.get("r"), cfg.get("lora_alpha"), cfg.get("lora_dropout") or 0.0
    number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
    if not (isinstance(r, int) and not isinstance(r, bool) and r >= 1):
        raise ValueError(f"{cfg_path}: r must be a positive integer (the LoRA rank), got {r!r}")
    if not (number(alpha) and math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"{cfg_path}: lora_alpha must be a finite number > 0, got {alpha!r}")
    if not (number(dropout) and 0 <= dropout < 1):
        raise ValueError(f"{cfg_path}: lora_dropout must be a number in [0, 1), got {dropout!r}")
    unsupported = [f"{k}={cfg[k]!r}" for k, ok in (("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False),
                                                   ("lora_bias", False)) if cfg.get(k, ok) != ok]
    unsupported += [f"{k}={cfg[k]!r}" for k in ("rank_pattern", "alpha_pattern") if cfg.get(k)]
    saved = cfg.get("modules_to_save") or []
    if not isinstance(saved, list) or not set(saved) <= set(NORMS):
        unsupported.append(f"modules_to_save={saved!r} (only {list(NORMS)}, the trained RMSNorms)")
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']!r}")
    if unsupported:
        raise ValueError(f"{cfg_path}: unsupported LoRA options {', '.join(unsupported)} "
                         f"(plain LoRA with uniform r and alpha only)")


def _check_weight(t, key, w_path, shape):
    """A float tensor of `shape` (None in a dimension: any size), finite; else ValueError naming the file."""
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{w_path}: {key} has dtype {t.dtype}; LoRA and norm weights are float32, bfloat16, "
                         f"float16 or float64")
    if t.dim() != len(shape) or any(want is not None and have != want for have, want in zip(t.shape, shape)):
        want = "(" + ", ".join("?" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"
        raise ValueError(f"{w_path}: {key} has shape {tuple(t.shape)}, expected {want}")
    return hub.check_tensor(t, key, w_path)


def read_adapter(dir, with_norms=False):
    """A PEFT LoRA folder → (config dict, {our module name: (A (r, K), B (N, r))}), checked (module
    docstring); with with_norms, also {our module name: weight (H,)} of its trained norms (modules_to_save)."""
    if not os.path.isdir(dir):
        raise FileNotFoundError(f"no adapter folder at {dir!r}")
    cfg_path, w_path = os.path.join(dir, CONFIG_NAME), os.path.join(dir, WEIGHTS_NAME)
    if not os.path.exists(cfg_path):
        raise FileNotFoundError(f"{dir}: no {CONFIG_NAME}; is this a PEFT adapter folder?")
    if not os.path.exists(w_path):
        hint = " (adapter_model.bin, PEFT's old pickle format, is not read: re-save with safetensors)" \
            if os.path.exists(os.path.join(dir, "adapter_model.bin")) else ""
        raise FileNotFoundError(f"{dir}: no {WEIGHTS_NAME}{hint}")
    cfg = hub.read_json(cfg_path)
    _check_config(cfg, cfg_path)
    saved, r = cfg.get("modules_to_save") or [], cfg["r"]
    try:
        with safe_open(w_path, "pt") as f:
            raw = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as e:
        raise ValueError(f"{w_path}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    pairs, norms = {}, {}
    for key, t in raw.items():
        parsed = module_of_key(key)
        norm = key[len(PEFT_PREFIX + "model."):-len(".weight")] if key.startswith(PEFT_PREFIX + "model.") \
            and key.endswith(".weight") else None
        if parsed is None and norm is not None and norm.split(".")[-1] in saved:
            norms[norm] = _check_weight(t, key, w_path, (None,))
            continue
        if parsed is None:
            raise ValueError(f"{w_path}: unexpected tensor {key!r}; expected only "
                             f"'{PEFT_PREFIX}model.<module>.lora_A.weight' / '.lora_B.weight' keys"
                             + (f" and the weights of {saved}" if saved else ""))
        pairs.setdefault(parsed[0], {})[parsed[1]] = (key, t)
    if saved and not norms:
        raise ValueError(f"{w_path}: {CONFIG_NAME} lists modules_to_save {saved} but the file holds none of them")
    if not pairs:
        raise ValueError(f"{w_path}: no LoRA tensors")
    out = {}
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{w_path}: module {name} has lora_{''.join(ab)} but not both lora_A and lora_B")
        (ka, a), (kb, b) = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{w_path}: {name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have "
                             f"rank r={r} from {CONFIG_NAME}")
        out[name] = (_check_weight(a, ka, w_path, (r, None)), _check_weight(b, kb, w_path, (None, r)))
    return (cfg, out, norms) if with_norms else (cfg, out)


def adapter_fits(config, pairs, where):
    """Check, before a model loads, that an adapter's modules and shapes (read_adapter's `pairs`) are those
    of the model that model.Config `config` describes; raise ValueError naming `where` (the adapter
    folder) otherwise, e.g. for an adapter trained on another model."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"q_proj": (q, config.hidden_size), "k_proj": (kv, config.hidden_size), "v_proj": (kv, config.hidden_size),
              "o_proj": (config.hidden_size, q), "gate_proj": (config.intermediate_size, config.hidden_size),
              "up_proj": (config.intermediate_size, config.hidden_size),
              "down_proj": (config.hidden_size, config.intermediate_size)}  # (N, K) of each linear
    for name, (a, b) in pairs.items():
        parts = name.split(".")
        ok = len(parts) == 4 and parts[0] == "layers" and parts[1].isdigit() and parts[-1] in shapes
        if not ok or int(parts[1]) >= config.num_layers:
            raise ValueError(f"{where}: adapter module {name} is not in this model ({config.num_layers} layers); "
                             f"was the adapter trained on another model?")
        N, K = shapes[parts[-1]]
        if a.shape[1] != K or b.shape[0] != N:
            raise ValueError(f"{where}: adapter {name} is for a ({b.shape[0]}, {a.shape[1]}) weight, but this model's "
                             f"is ({N}, {K}); was the adapter trained on another model?")


# ---------------------------------------------------------------------------------------------
# Loading a folder into a model
# ---------------------------------------------------------------------------------------------

def load_adapter(model, dir, dtype=torch.float32):
    """Load a PEFT LoRA folder into `model`. If the model has no adapters yet, LoRA is applied with
    the folder's r, alpha and dropout on exactly the modules the folder holds (adapters in `dtype`);
    otherwise the model's adapters must match the folder's modules, rank and alpha. Trained norms
    (modules_to_save) are copied into the model's norm weights in place and made trainable
    (train_norms); a model whose norms are trained needs them in the folder. Returns the trainable
    parameters (LoRA's, then the norms')."""
    cfg, pairs, norms = read_adapter(dir, with_norms=True)
    if norms:
        want = norm_modules(model, cfg["modules_to_save"])
        missing, extra = sorted(set(want) - set(norms)), sorted(set(norms) - set(want))
        if missing or extra:
            raise KeyError(f"{dir}: trained norms do not match the model's: {len(missing)} of the model's are not "
                           f"in the folder (e.g. {missing[:3]}), {len(extra)} in the folder are not in the model "
                           f"(e.g. {extra[:3]})")
        bad = [n for n, t in norms.items() if t.shape != want[n].weight.shape]
        if bad:
            raise ValueError(f"{dir}: {bad[0]}.weight is {tuple(norms[bad[0]].shape)} in the folder, "
                             f"{tuple(want[bad[0]].weight.shape)} in the model")
    elif trained_norms(model):
        raise KeyError(f"{dir}: the model trains its norms ({model.modules_to_save}) but the folder has none "
                       f"(an adapter saved without --train-norms?)")
    names = {n for n, _ in model.named_modules()}
    absent = sorted(n for n in pairs if n not in names)
    if absent:
        raise KeyError(f"{dir}: adapter targets {len(absent)} modules this model lacks, e.g. {absent[:3]}; "
                       f"was it trained on another architecture?")
    mods = lora_modules(model)
    if not mods:  # exactly the folder's modules (full names: each targets its own module alone)
        apply_lora(model, cfg["r"], cfg["lora_alpha"], targets=sorted(pairs),
                   dropout=float(cfg.get("lora_dropout") or 0.0), dtype=dtype)
        mods = lora_modules(model)
    missing, extra = sorted(set(mods) - set(pairs)), sorted(set(pairs) - set(mods))
    if missing or extra:
        raise KeyError(f"{dir}: adapter modules do not match the model's: the model has {len(missing)} without "
                       f"weights in the folder (e.g. {missing[:3]}), the folder {len(extra)} the model has no "
                       f"adapter on (e.g. {extra[:3]})")
    for name, (a, b) in pairs.items():
        m = mods[name]
        if (m.rank, m.alpha) != (cfg["r"], cfg["lora_alpha"]):
            raise ValueError(f"{name}: the model's adapter has r={m.rank}, alpha={m.alpha}; the folder "
                             f"r={cfg['r']}, lora_alpha={cfg['lora_alpha']}")
        if a.shape != m.lora_A.weight.shape or b.shape != m.lora_B.weight.shape:
            raise ValueError(f"{name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} in the folder, "
                             f"{tuple(m.lora_A.weight.shape)} / {tuple(m.lora_B.weight.shape)} in the model")
        with torch.no_grad():
            m.lora_A.weight.copy_(a)
            m.lora_B.weight.copy_(b)
    norm_params = train_norms(model, tuple(cfg["modules_to_save"])) if norms else []
    with torch.no_grad():
        for name, t in norms.items():  # in place: the rollout's decoder keeps reading the same tensors
            model.get_submodule(name).weight.copy_(t)
    return [p for m in mods.values() for p in (m.lora_A.weight, m.lora_B.weight)] + norm_params


def load_policy(name, adapter=None, quant="nvfp4", device="cpu"):
    """(model, tokenizer): the base (NVFP4-quantized as it loads when quant='nvfp4') with the adapter
    applied when given: what eval.py evaluates and train.py trains."""
    if quant not in ("nvfp4", "bf16"):
        raise ValueError(f"quant must be 'nvfp4' or 'bf16', got {quant!r}")
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    m = Transformer.from_pretrained(name, dtype=dtype, device=device, quantize=quant == "nvfp4")
    if adapter:
        load_adapter(m, adapter)  # (into adapters made on the base's device)
    return m.eval(), hub.load_tokenizer(name)


# ---------------------------------------------------------------------------------------------
# Merge an adapter into a plain HF checkpoint
# ---------------------------------------------------------------------------------------------

def merge(model_path, adapter_dir, out, dtype=torch.bfloat16, force=False):
    """Write `out`: the checkpoint at `model_path` with W + scaling * B @ A on every adapted linear,
    every floating tensor in `dtype`, NVFP4 weights dequantized (and the quantization_config
    dropped), other files (tokenizer, generation config) copied. Streams tensor by tensor, shard by
    shard, so a large model is never whole in memory; every tensor read is checked finite. Atomic (a
    failed write, a full disk say, leaves `out` as it was: one OutputError line), and `out` may replace
    only an earlier merge, or with force any folder but the sources or the current folder (hub.new_folder)."""
    src = hub.resolve_model_dir(model_path)
    cfg, pairs, norms = read_adapter(adapter_dir, with_norms=True)
    scaling = cfg["lora_alpha"] / cfg["r"]
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    quantized = nvfp4.is_nvfp4_config(config)
    weight_map = nvfp4.weight_map(src)
    handles = {}

    def get(key):
        shard = weight_map[key]
        if shard not in handles:
            handles[shard] = safe_open(os.path.join(src, shard), "pt")
        return hub.check_tensor(handles[shard].get_tensor(key), key, os.path.join(src, shard))

    by_shard = {}
    for key, shard in weight_map.items():
        if quantized and key.endswith((".weight_scale", ".weight_global_scale")):
            continue  # read together with their weight_packed
        by_shard.setdefault(shard, []).append(key)
    used, new_map = set(), {}
    kept = f"{out} is left as it was" if os.path.exists(out) else f"nothing was left at {out}"
    with hub.new_folder(out, "adapters.py", sources=[src, adapter_dir], force=force) as tmp:
        for shard, keys in by_shard.items():  # one output shard in memory at a time
            outputs = {}
            for key in keys:
                if quantized and key.endswith(".weight_packed"):
                    stem = key[: -len("weight_packed")]
                    q = nvfp4.NVFP4Tensor(get(key), get(stem + "weight_scale"), get(stem + "weight_global_scale"))
                    key, t = stem + "weight", nvfp4.dequantize(q)  # (N, K) float32
                else:
                    t = get(key)
                module = key[len("model."):-len(".weight")] if key.startswith("model.") and key.endswith(".weight") else None
                if module in pairs:
                    a, b = pairs[module]
                    delta = scaling * (b.float() @ a.float())  # (N, K)
                    if delta.shape != t.shape:
                        raise ValueError(f"{key}: weight {tuple(t.shape)} but adapter B @ A is {tuple(delta.shape)}")
                    t = t.float() + delta
                    used.add(module)
                elif module in norms:  # a trained norm replaces the base's
                    if norms[module].shape != t.shape:
                        raise ValueError(f"{key}: weight {tuple(t.shape)} but the adapter's is {tuple(norms[module].shape)}")
                    t = norms[module]
                    used.add(module)
                outputs[key] = t.to(dtype) if t.is_floating_point() else t
                new_map[key] = shard
            with hub.writing(os.path.join(out, shard), kept):
                save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(tmp, shard),
                          metadata={"format": "pt"})
        unused = sorted((set(pairs) | set(norms)) - used)
        if unused:
            raise KeyError(f"{adapter_dir}: adapter modules with no weight in {src}, e.g. {unused[:3]}")
        config.pop("quantization_config", None)
        name = str(dtype).removeprefix("torch.")
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = name
        with hub.writing(out, kept):  # the small files: the index, config.json, the tokenizer's
            if len(set(weight_map.values())) > 1:
                with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                    json.dump({"metadata": {}, "weight_map": new_map}, f, indent=2)
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
            for fname in os.listdir(src):
                skip = fname.endswith(".safetensors") or fname in ("config.json", "model.safetensors.index.json")
                if not skip and os.path.isfile(os.path.join(src, fname)):
                    shutil.copy(os.path.join(src, fname), os.path.join(tmp, fname))
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description="Adapter tools: merge a PEFT LoRA adapter into an HF checkpoint.")
    parser.add_argument("--merge", action="store_true", help="merge --adapter into --model and write --out")
    parser.add_argument("--model", required=True, help="base HF folder (bf16 or NVFP4), alias (qwen2.5-7b, tiny) or hub id")
    parser.add_argument("--adapter", required=True, help="PEFT adapter folder (adapter_config.json + adapter_model.safetensors)")
    parser.add_argument("--out", required=True, help="output checkpoint folder: new, empty, or an earlier merge "
                        "(which it replaces)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty --out this command did not write "
                        "(never the model, the adapter, the current folder or one holding them)")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                        help="dtype of the merged checkpoint's floating tensors")
    args = parser.parse_args(argv)
    if not args.merge:
        parser.error("nothing to do: pass --merge")
    with hub.stop_on_bad_input("adapters.py"):  # the model, the adapter and --out first, before any writing
        src, _, config = read_config(args.model)
        cfg, pairs = read_adapter(args.adapter)
        adapter_fits(config, pairs, args.adapter)
        hub.check_out(args.out, "adapters.py", sources=[src, args.adapter], force=args.force)
        print(f"merging {len(pairs)} LoRA modules (r={cfg['r']}, alpha={cfg['lora_alpha']}, "
              f"scaling={cfg['lora_alpha'] / cfg['r']:g}) into {args.model} → {args.out} ({args.dtype})")
        merge(src, args.adapter, args.out, getattr(torch, args.dtype), force=args.force)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
