"""Adaptive Quantization Noise (AQN, QeRL arXiv 2510.11696, Sec. 3.3): exploration noise on the
RMSNorm weights during rollout, with a sigma that decays over training stages.

Why noise. QeRL observes that the NVFP4 base's quantization error raises the policy's entropy,
which helps RL explore early on. That error is static (fixed once the weights are quantized); AQN
adds a controllable, decaying part: before each rollout step it draws, for every decoder RMSNorm, a
fresh channel-wise vector

    Z ~ N(0, sigma² I_H)        H = hidden size

and uses w + Z as that norm's weight for the whole rollout, then puts w back.

Why on the norm weight (and why that is free). An RMSNorm followed by a linear layer W (N, H)
computes, for a token x (H,) with x̂ = x / rms(x):

    ((w + Z) ⊙ x̂) W^T  =  x̂ diag(w + Z) W^T  =  x̂ (W diag(w + Z))^T

so noise on the norm weight is exactly noise on the following weight matrix, structured: each input
channel j of W (column j, the same factor for every output row: a row-broadcast vector) is scaled
by (w_j + Z_j) instead of w_j, i.e. W's columns get the multiplicative noise (1 + Z_j / w_j). The
input norm feeds q, k and v; the post-attention norm feeds gate and up, so all five see the noise
(o and down are not behind a norm and get none, in the paper too). Perturbing the NVFP4 weights
themselves would mean re-quantizing 4-bit tensors every step; this costs one vector add of H floats
per norm per step, and the quantized kernels never know. The final norm (before lm_head, which stays
high precision) is left alone by default and can be included with final_norm=True.

Precision. model.py keeps RMSNorm weights in float32 for this: bf16's spacing near 1.0 is 2^-7 ≈
0.0078, so a sigma of 1e-4 … 1e-2 added to a bf16 weight of ~1 would mostly round back to the same
number. noise() refuses half-precision norm weights for that reason.

Schedule (AQNSchedule), as QeRL: the run's total_steps are cut into K stages (default 10) of equal
length; step s is in stage

    k = min(s * K // total_steps, K - 1)      (steps 0 … total_steps - 1; clamped at both ends)

stage 0 has no noise (the quantization noise alone, while the policy first adapts) and stage k ≥ 1
decays geometrically from sigma_start to sigma_end:

    sigma_k = sigma_start * (sigma_end / sigma_start) ** ((k - 1) / (K - 2))

so stage 1 has sigma_start and stage K-1 sigma_end (with K = 2 the only noisy stage uses
sigma_start). Defaults sigma_start 1e-2, sigma_end 1e-4, K = 10: the official training scripts
(training/dapo_qwen2.5-*_nvfp4_single_gpu.sh), the code released with the paper; the paper's text
says sigma_end 5e-4 (pass it to compare). The official trainer computes the same stages
(trl_trainer/noise_scheduler.py: K intervals of total_steps / K, the first without noise), with one
difference of counting: its steps count from 1 (replacement/trainer.py increments update_step before
the first rollout), ours from 0, so each of its stage boundaries comes one step earlier. Over the
paper's 500 steps that is stage 0 with 49 noise-free steps instead of 50 and the last stage with 51
instead of 50: a shift of one step in 50, kept rather than matched, because matching it moves every
boundary of the tiny demo's 30-step run (stages of 3 steps) and the curve the README reports.

Trained norms. With --train-norms (the official --ln True) the norm weights are parameters that the
optimizer moves; the noise is drawn around their current values at each rollout and the exact
trained values come back afterwards, so the optimizer never keeps any of it, and the update sees it
only with train.py's --aqn-update (tests/test_lora.py checks this around an optimizer step).

Usage: the caller (train.py) resamples once per rollout step and applies the noise to the rollout
only (the paper's setting; applying it to the update pass as well is the caller's choice):

    sched = AQNSchedule(total_steps)
    with aqn.noise(model, sched.sigma(step), generator=gen):
        batch = rollout.generate(model, prompts, ...)
    # the norm weights are bit-for-bit what they were, even if generate() raised

If the noise is also applied to an update pass, run backward inside the same `with` block: autograd
saved the (noisy) norm weight for backward, and the restore on exit is an in-place write that it
would detect (and gradient checkpointing would recompute the forward without the noise).

In place, on purpose. The noise is added with add_() into the norm weights' own memory and the
saved copies are copy_()'d back on exit, instead of swapping in new tensors: a decode step captured
in a CUDA graph (engine/decode.py) replays reads of fixed addresses, so only an in-place change is seen by
the replay, and the restore is exact because it copies the saved bits rather than subtracting Z.

Departures from the official code, and the tests for them. The official QeRL code finds the norms to
perturb by isinstance against the transformers RMSNorm class, but it runs its rollout in vLLM, whose
models use vLLM's own RMSNorm class: the match finds nothing and, as far as we can read, AQN adds no
noise at all, silently. Here norms are found by their role in the decoder (the modules named
input_layernorm / post_attention_layernorm, and norm), which holds for our model, transformers' and
vLLM's alike, and noise() raises when it finds none, when the count is not 2 per decoder layer, or
when a noisy call leaves a norm unchanged. tests/test_aqn.py checks the count and that logits move.
Were the official match to succeed, it would noise every RMSNorm, the final one before lm_head included,
by add_() into vLLM's weights and never take the noise out: each rollout's draw would add to the last
ones (a random walk whose std grows as the square root of the steps) unless something loads the
trainer's norm weights into vLLM again between rollouts, which we could not find on its LoRA path (it
hands vLLM the adapters). Here each rollout draws fresh noise around the exact weights and restores
them bit for bit, on the two norms of every block (final_norm=True adds the final one).
"""
import argparse
import math
from contextlib import contextmanager
from dataclasses import dataclass

import torch

LAYER_NORMS = ("input_layernorm", "post_attention_layernorm")  # feed q/k/v and gate/up
FINAL_NORMS = ("norm", "model.norm")  # ours, transformers' (…ForCausalLM.model.norm)


class AQNSchedule:
    """QeRL's stage-wise geometric decay of the AQN sigma; see the module docstring."""

    def __init__(self, total_steps, stages=10, sigma_start=1e-2, sigma_end=1e-4):
        if total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {total_steps}")
        if stages < 2:
            raise ValueError(f"stages must be >= 2 (stage 0 is noise-free), got {stages}")
        if not (sigma_start > 0 and sigma_end > 0):
            raise ValueError(f"sigma_start and sigma_end must be > 0, got {sigma_start}, {sigma_end}")
        self.total_steps, self.stages = total_steps, stages
        self.sigma_start, self.sigma_end = sigma_start, sigma_end

    def stage(self, step):
        """The stage (0 … K-1) of training step `step` (0-based)."""
        return min(max(step * self.stages // self.total_steps, 0), self.stages - 1)

    def stage_sigma(self, k):
        if k == 0:
            return 0.0
        exponent = (k - 1) / (self.stages - 2) if self.stages > 2 else 0.0
        return self.sigma_start * (self.sigma_end / self.sigma_start) ** exponent

    def sigma(self, step):
        """The noise std to use at training step `step`."""
        return self.stage_sigma(self.stage(step))

    def __repr__(self):
        return (f"AQNSchedule(total_steps={self.total_steps}, stages={self.stages}, "
                f"sigma_start={self.sigma_start:g}, sigma_end={self.sigma_end:g})")


def _num_layers(model):
    cfg = getattr(model, "config", None)
    for field in ("num_layers", "num_hidden_layers"):  # ours, transformers'
        if cfg is not None and isinstance(getattr(cfg, field, None), int):
            return getattr(cfg, field)
    return None


def find_norms(model, final_norm=False):
    """{name: weight tensor} of the decoder RMSNorms AQN perturbs. Raises when the model has none,
    when their number is not 2 per decoder layer (+1 with final_norm), or when a weight is not a 1-D
    float32/float64 vector."""
    modules = dict(model.named_modules())
    found = {name: m for name, m in modules.items() if name.split(".")[-1] in LAYER_NORMS}
    if not found:
        raise LookupError(f"AQN: no module named {' or '.join(LAYER_NORMS)} in {type(model).__name__}; the "
                          f"noise would reach nothing (the official QeRL hook's failure). Is this a decoder LM?")
    layers = _num_layers(model)
    if layers is not None and len(found) != 2 * layers:
        raise LookupError(f"AQN: found {len(found)} decoder norms in {type(model).__name__}, expected "
                          f"2 x {layers} layers = {2 * layers}")
    if final_norm:
        final = [n for n in FINAL_NORMS if n in modules]
        if not final:
            raise LookupError(f"AQN: final_norm=True but {type(model).__name__} has no module named "
                              f"{' or '.join(FINAL_NORMS)}")
        found[final[0]] = modules[final[0]]
    weights = {}
    for name, m in found.items():
        w = getattr(m, "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 1:
            raise TypeError(f"AQN: {name} ({type(m).__name__}) has no 1-D weight to perturb")
        if w.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"AQN: {name}.weight is {w.dtype}; noise of sigma ~1e-3 on a weight near 1 is mostly "
                            f"rounded away below float32 (keep RMSNorm weights in float32, as model.py does)")
        weights[name] = w
    return weights


@dataclass
class NoiseInfo:
    sigma: float
    names: list  # the norms perturbed, in model order
    modified: int  # how many of them actually changed (== len(names) whenever sigma > 0)


@contextmanager
def noise(model, sigma, generator=None, final_norm=False):
    """Add fresh Z ~ N(0, sigma² I) to every decoder RMSNorm weight (and the final norm's with
    final_norm=True) in place for the duration of the block; restore the exact saved weights on exit,
    also when the block raises. sigma = 0 changes nothing (but still checks the norms are there, so
    a model AQN cannot reach fails at step 0, not at the first noisy stage). Yields a NoiseInfo."""
    if not (math.isfinite(sigma) and sigma >= 0):  # (NaN would add no noise, silently; inf wipes the norms)
        raise ValueError(f"AQN sigma must be a finite number >= 0, got {sigma}")
    weights = find_norms(model, final_norm)
    saved = {}
    try:
        modified = 0
        with torch.no_grad():
            for name, w in weights.items():
                saved[name] = w.detach().clone()
                if sigma > 0:
                    gen_device = generator.device if generator is not None else w.device
                    z = torch.randn(w.shape, generator=generator, device=gen_device, dtype=torch.float32)  # (H,)
                    w.add_((z * sigma).to(device=w.device, dtype=w.dtype))
                    modified += int(not torch.equal(w, saved[name]))
        if sigma > 0 and modified != len(weights):
            largest = max(float(s.abs().max()) for s in saved.values())
            hint = (f": their weights reach {largest:.3g}, where float32 cannot hold a change of sigma; a norm weight "
                    f"is about 1, so the run has diverged (lower --lr)") if largest > 2**20 * sigma else ""
            raise RuntimeError(f"AQN: sigma={sigma:g} left {len(weights) - modified} of {len(weights)} norms "
                               f"unchanged{hint}")
        yield NoiseInfo(float(sigma), list(weights), modified)
    finally:
        with torch.no_grad():
            for name, s in saved.items():
                weights[name].copy_(s)


def main():
    parser = argparse.ArgumentParser(description="Print QeRL's AQN sigma schedule: stage and sigma per stage boundary.")
    parser.add_argument("--total-steps", type=int, required=True, help="training steps of the run")
    parser.add_argument("--stages", type=int, default=10, help="number of stages K (stage 0 has no noise)")
    parser.add_argument("--sigma-start", type=float, default=1e-2, help="sigma of stage 1")
    parser.add_argument("--sigma-end", type=float, default=1e-4, help="sigma of the last stage (official scripts; "
                        "the paper's text: 5e-4)")
    args = parser.parse_args()
    sched = AQNSchedule(args.total_steps, args.stages, args.sigma_start, args.sigma_end)
    print(sched)
    first = {}
    for step in range(args.total_steps):
        first.setdefault(sched.stage(step), step)
    for k, step in sorted(first.items()):
        print(f"stage {k:2d}: from step {step:6d}  sigma {sched.stage_sigma(k):.3e}")


if __name__ == "__main__":
    main()
