"""LoRA: the only trained parameters, on top of a frozen (bf16 or NVFP4) base. PEFT-compatible.

LoRA (Hu et al. 2021) replaces the update of a frozen linear W (N, K) by a low-rank product:

    y = x W^T + b  +  (dropout(x) A^T) B^T * alpha / r        A (r, K), B (N, r)

A starts as PEFT initializes it (kaiming_uniform_ with a = sqrt(5), the nn.Linear default) and B at
zero, so the wrapped model starts exactly equal to its base and the first gradient reaches B only
(dL/dA = B^T (...) = 0 at step 0; B moves first, then A). "LoRA B never moves" is the classic silent
failure of RL codebases (an optimizer given the wrong parameters, a frozen flag set once too often):
tests/test_lora.py checks that B moves after one optimizer step, on a bf16/fp32 base and on NVFP4.

QeRL (arXiv 2510.11696, Sec. 3) puts the adapters on every decoder linear (q, k, v, o, gate, up,
down) of an NVFP4 base, rank 16–32. The base here is any module computing x -> x W^T + b:
nn.Linear, or fp4_gemm.QuantLinear, whose backward gives dX = dY · dequant(W) and no weight gradient,
so gradients flow through the 4-bit base into A and B without a bf16 copy of W ever being kept.

Precision. The adapters live in float32 by default (apply_lora's dtype= gives bf16): RL updates with lr ~1e-5 are
smaller than bf16's resolution on a weight of size ~1e-2. The LoRA branch is computed in x's dtype,
as torch.autocast would: the float32 adapters are the master copy, cast per call (r x K, tiny), and
their gradients come back in float32. (PEFT without autocast casts x up to the adapters' float32
instead; on the GPU that makes the branch float32 GEMMs without tensor cores plus copies of every
activation: results/bench_h200.md. The rollout computes the branch in bf16 too, so sampler and
trainer agree on it.)

Reference policy for free. GRPO's KL term needs the base model's log-probabilities. With LoRA the base
model IS the policy with its adapters switched off, so `with disable_adapters(model):` gives it
without a second copy of the weights.

PEFT format. `save_adapter` writes the folder PEFT writes (adapter_config.json +
adapter_model.safetensors) with PEFT's key names: our module `layers.0.self_attn.q_proj` is the HF
module `model.layers.0.self_attn.q_proj`, and PEFT wraps the whole HF model once more, giving
`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`. So `peft.PeftModel.from_pretrained`
on the transformers model loads our adapters (same logits), and `load_adapter` reads PEFT's.
Supported: plain LoRA (no DoRA, rsLoRA, per-module rank/alpha patterns or bias training) and trained
RMSNorm weights as `modules_to_save`; anything else is refused with a message rather than loaded wrongly.

Trained norms. The official QeRL scripts (`--ln True`) also train the two RMSNorm weights of every
block, through PEFT's `modules_to_save` on input_layernorm and post_attention_layernorm: H numbers per
norm, 2 x 28 x 3584 = 0.2M for Qwen2.5-7B, next to its 40M LoRA parameters at rank 16 (81M at 32). `train_norms(model)`
makes them trainable in place (they are float32 already: model.py keeps them so, and that is the
master copy); the optimizer then updates the very tensors the rollout reads, which matters because
the CUDA-graph decoder replays reads of fixed addresses (an update must be in place, never a new
tensor: tests/test_lora.py checks the data_ptr across an optimizer step). AQN's noise is added to
their current values during a rollout and restored bit for bit (aqn.noise). In the adapter folder
they are what PEFT writes for modules_to_save: the config lists the module names, and the tensor of
`model.layers.0.input_layernorm` is stored as `base_model.model.model.layers.0.input_layernorm.weight`
(PEFT strips its in-memory `.modules_to_save.default` on save and puts it back on load), so
`peft.PeftModel.from_pretrained` loads adapter and norms onto the transformers model with our
logits, `load_adapter` loads both, and `merge` writes the trained norms into the merged checkpoint.
`disable_adapters` gives the base norms too, as PEFT's disable_adapter does for modules_to_save.

Export: `python lora.py --merge --model BASE --adapter DIR --out DST` folds W + alpha/r · B A into a
plain bf16 HF checkpoint (NVFP4 bases are dequantized first), one tensor at a time.
"""
import argparse
import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

import fp4_gemm
import nvfp4
import hub
from model import hf_key, read_config

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PeftModel wraps the HF model: peft.base_model.model is the HF model


class LoRALinear(nn.Module):
    """base(x) + lora_B(lora_A(dropout(x))) * scaling, with scaling = alpha / rank; base frozen."""

    def __init__(self, base, rank, alpha, dropout=0.0, dtype=torch.float32):
        super().__init__()
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.rank, self.alpha = rank, alpha
        self.scaling = alpha / rank
        device = next(t for t in list(base.parameters()) + list(base.buffers())).device
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device, dtype=dtype)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device, dtype=dtype)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # PEFT's default init of A
        nn.init.zeros_(self.lora_B.weight)  # so that the wrapped model starts equal to its base
        for p in base.parameters():
            p.requires_grad_(False)
        self.disabled = False  # set by disable_adapters()

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)  # (T, K)
        y = self.base(x2)  # (T, N)
        if not self.disabled:
            dt = x.dtype
            a = nn.functional.linear(self.lora_dropout(x2), self.lora_A.weight.to(dt))  # (T, r)
            b = (self.lora_B.weight * self.scaling).to(y.dtype)  # (N, r): scaled here, not the (T, N) output
            # y += a b^T as one GEMM whose epilogue adds y (no separate passes over the output to scale and
            # add), in place: y is the base's fresh output, which its backward does not keep (out of place,
            # addmm would first copy all of y)
            y.addmm_(a.to(y.dtype), b.t())
        return y.view(*x.shape[:-1], self.out_features)

    def delta_weight(self):
        """scaling * B @ A (N, K) in float32: what merging adds to W."""
        return self.scaling * (self.lora_B.weight.float() @ self.lora_A.weight.float())

    def extra_repr(self):
        return f"rank={self.rank}, alpha={self.alpha}, scaling={self.scaling:g}, dtype={self.lora_A.weight.dtype}"


def lora_modules(model):
    """{module name: LoRALinear} in model order."""
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def _apply(model, filter, rank, alpha, dropout, dtype):
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters; apply_lora twice would stack them")
    if trained_norms(model):  # (the freeze below would silently stop the norms training)
        raise ValueError("apply_lora after train_norms would freeze the trained norms; call train_norms after apply_lora")
    for p in model.parameters():  # everything frozen: base weights, embeddings, norms, lm_head
        p.requires_grad_(False)
    new = model.swap_linears(lambda name, m: LoRALinear(m, rank, alpha, dropout, dtype), filter)
    if not new:
        raise ValueError("apply_lora matched no linear layer; check the target names")
    return [p for m in new.values() for p in (m.lora_A.weight, m.lora_B.weight)]


def _is_base_linear(m):
    return isinstance(m, (nn.Linear, fp4_gemm.QuantLinear))


def apply_lora(model, rank=32, alpha=32, targets=TARGETS, dropout=0.0, dtype=torch.float32):
    """Wrap every linear whose last name is in `targets` (lm_head is never one) with LoRALinear,
    freeze everything else, and return the trainable parameters [A0, B0, A1, B1, ...]."""
    targets = tuple(targets)
    return _apply(model, lambda name, m: _is_base_linear(m) and name.split(".")[-1] in targets and name != "lm_head",
                  rank, alpha, dropout, dtype)


NORMS = ("input_layernorm", "post_attention_layernorm")  # the official --ln True modules_to_save


def norm_modules(model, names=NORMS):
    """{module name: module} of the modules whose last name is in `names`, in model order."""
    return {n: m for n, m in model.named_modules() if n.split(".")[-1] in names}


def train_norms(model, names=NORMS):
    """Make the weights of every module named in `names` (the blocks' RMSNorms) trainable, in place, and
    remember the base values for disable_adapters. Returns the parameters [norm0.weight, ...]. Call it
    after apply_lora (which freezes everything but the adapters)."""
    mods = norm_modules(model, names)
    if not mods:
        raise ValueError(f"train_norms: no module named {' or '.join(names)} in {type(model).__name__}")
    for name, m in mods.items():
        w = getattr(m, "weight", None)
        if not isinstance(w, nn.Parameter) or w.dim() != 1 or w.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"train_norms: {name} needs a 1-D float32 weight parameter (an lr-1e-5 update of a "
                            f"weight near 1 is lost in bf16), got {getattr(w, 'dtype', None)}")
        w.requires_grad_(True)
    if getattr(model, "modules_to_save", None) is None:  # a second call keeps the first base values
        model.__dict__["base_norms"] = {n: m.weight.detach().clone() for n, m in mods.items()}
    model.__dict__["modules_to_save"] = tuple(names)
    return [m.weight for m in mods.values()]


def trained_norms(model):
    """{module name: weight parameter} of the norms train_norms made trainable ({} when none)."""
    names = getattr(model, "modules_to_save", None)
    return {n: m.weight for n, m in norm_modules(model, names).items()} if names else {}


@contextmanager
def disable_adapters(model):
    """Within the block the model is its base (every adapter skipped, trained norms at their base
    values); restored on exit, even when the block raises. Nested use is fine: each level restores the
    states it found. The norms are swapped in place (the decoder reads fixed addresses), which bumps
    their autograd version: run a reference forward before, not between, a policy forward and its
    backward."""
    mods = list(lora_modules(model).values())
    before = [m.disabled for m in mods]
    norms, base = trained_norms(model), model.__dict__.get("base_norms", {})
    saved = {}
    try:
        for m in mods:
            m.disabled = True
        with torch.no_grad():
            for n, w in norms.items():
                saved[n] = w.detach().clone()
                w.copy_(base[n])
        yield model
    finally:
        for m, d in zip(mods, before):
            m.disabled = d
        with torch.no_grad():
            for n, t in saved.items():
                norms[n].copy_(t)


# ---------------------------------------------------------------------------------------------
# PEFT adapter folders
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


def _uniform(mods, attr):
    values = {getattr(m, attr) for m in mods.values()}
    if len(values) != 1:
        raise ValueError(f"adapters with different {attr}s {sorted(values)} need PEFT's rank/alpha patterns, "
                         f"which this writer does not produce")
    return values.pop()


def save_adapter(model, dir, base_model_name_or_path=None):
    """Write `dir` as a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors).
    The folder is built under a temporary name next to `dir` and renamed into place, so a crash
    never leaves half an adapter; an existing adapter folder at `dir` is replaced."""
    mods = lora_modules(model)
    if not mods:
        raise ValueError("the model has no LoRA adapters to save")
    rank, alpha = _uniform(mods, "rank"), _uniform(mods, "alpha")
    dropouts = {m.lora_dropout.p if isinstance(m.lora_dropout, nn.Dropout) else 0.0 for m in mods.values()}
    leaves = sorted({n.split(".")[-1] for n in mods})
    # PEFT matches a target name against the end of each module's dotted name. If our adapters
    # cover every layer with those names (apply_lora always does), the short names are the config;
    # otherwise list the full HF module names, which match exactly those modules and no others.
    everywhere = {n for n, m in model.named_modules()
                  if n.split(".")[-1] in leaves and (_is_base_linear(m) or isinstance(m, LoRALinear))}
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
    tmp = tempfile.mkdtemp(prefix=".adapter-", dir=parent)
    try:
        hub.normal_permissions(tmp)  # (mkdtemp's 0700 would hide the adapter from other users)
        save_file(tensors, os.path.join(tmp, WEIGHTS_NAME), metadata={"format": "pt"})
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


def read_adapter(dir, with_norms=False):
    """A PEFT LoRA folder → (config dict, {our module name: (A (r, K), B (N, r))}), checked; with
    with_norms, also {our module name: weight (H,)} of its trained norms (modules_to_save)."""
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
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type is {cfg.get('peft_type')!r}, only LORA adapters are supported")
    for field in ("r", "lora_alpha"):
        if not isinstance(cfg.get(field), (int, float)) or cfg[field] <= 0:
            raise ValueError(f"{cfg_path}: {field} must be a positive number, got {cfg.get(field)!r}")
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
            if t.dim() != 1:
                raise ValueError(f"{w_path}: {key} is {tuple(t.shape)}, a norm weight is 1-D")
            norms[norm] = t
            continue
        if parsed is None:
            raise ValueError(f"{w_path}: unexpected tensor {key!r}; expected only "
                             f"'{PEFT_PREFIX}model.<module>.lora_A.weight' / '.lora_B.weight' keys"
                             + (f" and the weights of {saved}" if saved else ""))
        pairs.setdefault(parsed[0], {})[parsed[1]] = t
    if saved and not norms:
        raise ValueError(f"{w_path}: {CONFIG_NAME} lists modules_to_save {saved} but the file holds none of them")
    if not pairs:
        raise ValueError(f"{w_path}: no LoRA tensors")
    out = {}
    r = cfg["r"]
    for name, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{w_path}: module {name} has lora_{''.join(ab)} but not both lora_A and lora_B")
        a, b = ab["A"], ab["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != r or b.shape[1] != r:
            raise ValueError(f"{w_path}: {name}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not have "
                             f"rank r={r} from {CONFIG_NAME}")
        out[name] = (a, b)
    return (cfg, out, norms) if with_norms else (cfg, out)


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
    if not mods:
        chosen = set(pairs)
        _apply(model, lambda name, m: _is_base_linear(m) and name in chosen,
               cfg["r"], cfg["lora_alpha"], float(cfg.get("lora_dropout") or 0.0), dtype)
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


# ---------------------------------------------------------------------------------------------
# Export: merge an adapter into a plain HF checkpoint
# ---------------------------------------------------------------------------------------------

def merge(model_path, adapter_dir, out, dtype=torch.bfloat16, force=False):
    """Write `out`: the checkpoint at `model_path` with W + scaling * B @ A on every adapted linear,
    every floating tensor in `dtype`, NVFP4 weights dequantized (and the quantization_config
    dropped), other files (tokenizer, generation config) copied. Streams tensor by tensor, shard by
    shard, so a large model is never whole in memory. Atomic, and `out` may replace only an earlier
    merge, or with force any folder but the sources or the current folder (hub.new_folder)."""
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
        return handles[shard].get_tensor(key)

    by_shard = {}
    for key, shard in weight_map.items():
        if quantized and key.endswith((".weight_scale", ".weight_global_scale")):
            continue  # read together with their weight_packed
        by_shard.setdefault(shard, []).append(key)
    used, new_map = set(), {}
    with hub.new_folder(out, "lora.py", sources=[src, adapter_dir], force=force) as tmp:
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
            save_file({k: v.contiguous() for k, v in outputs.items()}, os.path.join(tmp, shard), metadata={"format": "pt"})
        unused = sorted((set(pairs) | set(norms)) - used)
        if unused:
            raise KeyError(f"{adapter_dir}: adapter modules with no weight in {src}, e.g. {unused[:3]}")
        if len(set(weight_map.values())) > 1:
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {}, "weight_map": new_map}, f, indent=2)
        config.pop("quantization_config", None)
        name = str(dtype).removeprefix("torch.")
        config["torch_dtype" if "torch_dtype" in config else "dtype"] = name
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        for fname in os.listdir(src):
            skip = fname.endswith(".safetensors") or fname in ("config.json", "model.safetensors.index.json")
            if not skip and os.path.isfile(os.path.join(src, fname)):
                shutil.copy(os.path.join(src, fname), os.path.join(tmp, fname))
    return out


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


def load_policy(name, adapter=None, quant="nvfp4", device="cpu"):
    """(model, tokenizer): the base (NVFP4-quantized as it loads when quant='nvfp4') with the adapter
    applied when given: what eval.py evaluates and train.py trains."""
    import model as model_lib

    if quant not in ("nvfp4", "bf16"):
        raise ValueError(f"quant must be 'nvfp4' or 'bf16', got {quant!r}")
    dtype = torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    m = model_lib.Transformer.from_pretrained(name, dtype=dtype, device=device, quantize=quant == "nvfp4")
    if adapter:
        load_adapter(m, adapter)  # (into adapters made on the base's device)
    return m.eval(), hub.load_tokenizer(name)


def main(argv=None):
    parser = argparse.ArgumentParser(description="LoRA adapter tools: merge a PEFT LoRA adapter into an HF checkpoint.")
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
    with hub.stop_on_bad_input("lora.py"):  # the model, the adapter and --out first, before any writing
        src, _, config = read_config(args.model)
        cfg, pairs = read_adapter(args.adapter)
        adapter_fits(config, pairs, args.adapter)
        hub.check_out(args.out, "lora.py", sources=[src, args.adapter], force=args.force)
        print(f"merging {len(pairs)} LoRA modules (r={cfg['r']}, alpha={cfg['lora_alpha']}, "
              f"scaling={cfg['lora_alpha'] / cfg['r']:g}) into {args.model} → {args.out} ({args.dtype})")
        merge(src, args.adapter, args.out, getattr(torch, args.dtype), force=args.force)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
