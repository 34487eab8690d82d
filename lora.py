"""LoRA: the only trained parameters, on top of a frozen (bf16 or NVFP4) base.

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
`apply_lora` picks the linears as PEFT's target_modules do: a target names a module by the end of its
dotted name, so "q_proj" is every block's q projection and "layers.0.self_attn.q_proj" that one alone.

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

Trained norms. The official QeRL scripts (`--ln True`) also train the two RMSNorm weights of every
block, through PEFT's `modules_to_save` on input_layernorm and post_attention_layernorm: H numbers per
norm, 2 x 28 x 3584 = 0.2M for Qwen2.5-7B, next to its 40M LoRA parameters at rank 16 (81M at 32). `train_norms(model)`
makes them trainable in place (they are float32 already: model.py keeps them so, and that is the
master copy); the optimizer then updates the very tensors the rollout reads, which matters because
the CUDA-graph decoder replays reads of fixed addresses (an update must be in place, never a new
tensor: tests/test_lora.py checks the data_ptr across an optimizer step). AQN's noise is added to
their current values during a rollout and restored bit for bit (aqn.noise). `disable_adapters` gives
the base norms too, as PEFT's disable_adapter does for modules_to_save.

Files. adapters.py writes and reads these parameters as PEFT adapter folders (LoRA's A and B, and the
trained norms as modules_to_save), merges them into a plain checkpoint, and loads a policy (base,
quantization, adapter) for train.py and eval.py.
"""
import math
from contextlib import contextmanager

import torch
import torch.nn as nn

import fp4_gemm

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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


def wrappable(m):
    """Whether apply_lora can wrap module m: a linear it can put an adapter on (nn.Linear or an NVFP4
    QuantLinear)."""
    return isinstance(m, (nn.Linear, fp4_gemm.QuantLinear))


def targeted(name, targets):
    """Whether the module called `name` is one of `targets`, as PEFT's target_modules match: a target is
    the whole dotted name or its end ("q_proj" matches "layers.0.self_attn.q_proj")."""
    return any(name == t or name.endswith("." + t) for t in targets)


def apply_lora(model, rank=32, alpha=32, targets=TARGETS, dropout=0.0, dtype=torch.float32):
    """Wrap every linear that `targets` names (targeted; lm_head is never one) with LoRALinear, freeze
    everything else, and return the trainable parameters [A0, B0, A1, B1, ...]."""
    targets = tuple(targets)
    if lora_modules(model):
        raise ValueError("the model already has LoRA adapters; apply_lora twice would stack them")
    if trained_norms(model):  # (the freeze below would silently stop the norms training)
        raise ValueError("apply_lora after train_norms would freeze the trained norms; call train_norms after apply_lora")
    for p in model.parameters():  # everything frozen: base weights, embeddings, norms, lm_head
        p.requires_grad_(False)
    new = model.swap_linears(lambda name, m: LoRALinear(m, rank, alpha, dropout, dtype),
                             lambda name, m: wrappable(m) and targeted(name, targets) and name != "lm_head")
    if not new:
        raise ValueError("apply_lora matched no linear layer; check the target names")
    return [p for m in new.values() for p in (m.lora_A.weight, m.lora_B.weight)]


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
