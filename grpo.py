"""GRPO: group-relative advantages and the clipped, KL-regularised token loss (DeepSeekMath §4.1).

GRPO (Shao et al. 2024, arXiv 2402.03300) is PPO without a value network. For each prompt q the old
policy samples a GROUP of G completions o_1..o_G; each gets a scalar reward r_i, and the baseline is
the group's own mean reward:

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)              one advantage per completion,
                                                                      shared by all its tokens
The loss for the policy pi_theta (the negated objective, eq. 3 of the paper) is

    L = 1/G sum_i 1/|o_i| sum_t [ -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)
                                  + beta * k3_it ]
    rho_it = exp(logp_it - old_logp_it)                               importance ratio
    k3_it  = exp(ref_it - logp_it) - (ref_it - logp_it) - 1           Schulman's k3 estimator of
                                                                      KL(pi_theta || pi_ref), >= 0

Shapes: rewards (num_groups, G); logp, old_logp, ref_logp, mask, entropy (B, T), per completion
token, with mask 1 on completion tokens and 0 on prompt/padding; advantages (B,) or (B, T).

Why the clip kills gradients where it does. With A > 0 the min picks the clipped term once
rho > 1 + eps_high: the loss is then the constant -(1 + eps_high) A and the token's gradient is
exactly zero (the policy already moved far enough towards it). With A < 0 the same happens once
rho < 1 - eps_low. Elsewhere the unclipped term is the min and the gradient is -A rho dlogp. The
metrics `clip_frac_high` / `clip_frac_low` count exactly those zero-gradient tokens (A > 0 and
rho > 1 + eps_high; A < 0 and rho < 1 - eps_low), over masked tokens.

Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games"; as in verl, c = 3). With
A < 0 the PPO loss -rho A is unbounded in rho: a token the old policy found unlikely but the current
one likes (rho >> 1) can produce a huge update. The dual clip caps the loss at c |A|:

    loss_it = min(ppo_loss_it, -c A_i)      for A_i < 0 (c > 1), unchanged for A_i >= 0

so tokens with A < 0 and rho > c get zero gradient (`dual_clip_frac`). Off by default (None).

Which policy the ratio is against: the sampler or the trainer. Here the sampler (rollout.py: the
NVFP4 kernels, bf16 LoRA, AQN noise on the norms) and the trainer (the update's forward, without the
noise) are two numerically different policies, pi_s and pi_t, even at the same parameters. Three
choices of old_logp (`sampler_correction(mode, ...)` returns old_logp and is_weight for this loss):

    "trainer"  old = logp_t.detach()          rho = 1 in a single pass, w = 1
                                              the official QeRL code (TRL, num_iterations = 1): the
                                              sampler's tokens are trained on as if on-policy
    "sampler"  old = logp_s                   rho = pi_t / pi_s: the textbook off-policy ratio; it
                                              clips and damps exactly the tokens the noise made likely
    "tis"      old = logp_t.detach(),         the clip on the trainer's own ratio, and each token's
               w = min(pi_t / pi_s, C)        policy-gradient term times a truncated importance weight
                                              (detached): FlashRL's TIS, verl, TRL's
                                              vllm_importance_sampling_correction

with the per-token loss w_it * ppo_it (+ beta k3_it: the weight multiplies the policy-gradient term
only, as TRL applies it). With more than one pass over a batch, "trainer"'s old_logp is the trainer's
logp from the first pass (the policy before the update), which is what TRL computes for
num_iterations > 1. Given `sampler_logp`, policy_loss also measures the mismatch on the sampled
tokens: `mismatch_kl` = mean k3 estimate of KL(pi_s || pi_t) (x = logp_t - logp_s, e^x - x - 1,
unbiased for tokens drawn from pi_s), `mismatch_ratio_max` = the largest pi_t / pi_s, and with
`tis_cap` C, `tis_clip_frac` = the fraction of tokens whose pi_t / pi_s exceeds C.

Loss aggregation (`agg`), with m the mask, l_it the per-token loss above (PPO term + beta k3),
S the number of sequences with at least one masked token and N the number of masked tokens:

    "seq-mean-token-mean"  1/S sum_b ( sum_t m_bt l_bt / sum_t m_bt )     GRPO as published
    "token-mean"           1/N sum_b sum_t m_bt l_bt                     DAPO (arXiv 2503.14476)
    "seq-sum-const"        1/S sum_b ( sum_t m_bt l_bt / const )         Dr. GRPO (arXiv 2503.20783)

Sequences whose mask is all zero (e.g. removed by DAPO's overlong filter) contribute nothing and are
not counted in S. For Dr. GRPO `const` must be given: the paper's objective has no length
normalisation at all (1/G sum_i sum_t), and a constant divisor only rescales the learning rate; the
generation budget (max new tokens) is the usual choice (TRL's "dr_grpo" loss uses it) because it
keeps the loss on the scale of a per-token mean.

Gradient accumulation. Every mode above is a SUM over sequences of a term that only needs that
sequence's own tokens, divided by a batch-level count (S or N). So when a batch is split into
micro-batches, passing the FULL batch's `num_seqs` (S) and `num_tokens` (N) to each call makes the
micro-batch losses add up exactly to the full-batch loss, and their gradients to its gradient
(`batch_counts(mask)` computes both). Left at None they default to the micro-batch's own counts,
which is right only without accumulation: averaging per-micro-batch means reweights tokens (the
classic accumulation bug; tests/test_grpo.py shows the difference).

What is kept from the paper and what is not, and why:
- Kept: outcome-supervised advantages normalised within the group (§4.1.2), the clipped surrogate,
  the KL to the reference added to the loss rather than to the reward, its k3 estimator (eq. 4),
  and the 1/|o_i| per-sequence mean (as the "seq-mean-token-mean" default).
- The std in A_i is the unbiased sample std (Bessel's correction, as torch.std, TRL and verl); the
  paper does not say which. Groups of one have no baseline: their advantage is 0.
- `std="batch"` divides by the std of all rewards in the batch (a more stable scale when some groups
  have tiny spreads); `std="none"` drops the division (Dr. GRPO: the group std up-weights prompts
  that are almost always solved or almost always failed, a difficulty bias).
- Not kept: process supervision (§4.1.3, per-step rewards from a process reward model) and
  iterative RL with a re-trained reward model (§4.1.4): our rewards are rule-based, outcome-only.
  The mu inner updates per rollout batch are the caller's loop; this loss allows old_logp != logp.
- The reference policy in QeRL is the same quantized base with the LoRA adapters disabled, not a
  separate copy; that is the caller's business: here ref_logp is just a tensor.
- Clip-higher (eps_low != eps_high) is DAPO's, exposed here because it is one line; dual clip is
  verl's, not DeepSeekMath's.
Pure torch: no model code, tested alone in tests/test_grpo.py.
"""
import torch

AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-sum-const")
STD_MODES = ("group", "batch", "none")
RATIO_MODES = ("trainer", "sampler", "tis")


def group_advantages(rewards, eps=1e-6, std="group"):
    """(num_groups, G) rewards -> (num_groups, G) advantages, (r - group mean) / (scale + eps).

    std: "group" divides by each group's unbiased std (DeepSeekMath), "batch" by the unbiased std
    of all rewards, "none" not at all (Dr. GRPO). Groups of one (G == 1) give zeros, no groups
    (num_groups == 0) an empty result.
    """
    if std not in STD_MODES:
        raise ValueError(f"std must be one of {STD_MODES}, got {std!r}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (num_groups, G), got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    if rewards.shape[1] < 2 or rewards.shape[0] == 0:
        # No baseline from a single sample, and no groups to score; also avoids the NaN (and torch's
        # warning) of an unbiased std over fewer than two values.
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)  # (num_groups, G)
    if std == "group":
        scale = rewards.std(dim=1, keepdim=True)  # (num_groups, 1)
    elif std == "batch":
        scale = rewards.std()
    else:
        return centered
    return centered / (scale + eps)


def k3_kl(logp, ref_logp):
    """Per-token k3 estimate of KL(pi || pi_ref) for tokens sampled from pi: e^x - x - 1, x = ref - logp."""
    x = ref_logp - logp
    return torch.exp(x) - x - 1


def sampler_correction(mode, logp, sampler_logp, tis_cap=None, trainer_logp=None):
    """(old_logp, is_weight) for policy_loss under ratio `mode` (see the module docstring).

    logp (B, T): the trainer's logp now (only its detached value is used); sampler_logp (B, T): the
    rollout's; trainer_logp: the trainer's logp before this update, where it differs from logp (a
    second pass over the batch), else None; tis_cap: C for "tis". is_weight is None or (B, T), detached;
    padding positions may hold anything (policy_loss masks them)."""
    if mode not in RATIO_MODES:
        raise ValueError(f"ratio mode must be one of {RATIO_MODES}, got {mode!r}")
    if mode == "sampler":
        return sampler_logp, None
    before = (logp if trainer_logp is None else trainer_logp).detach()  # (B, T)
    if mode == "trainer":
        return before, None
    if tis_cap is None or tis_cap <= 0:
        raise ValueError(f"ratio mode 'tis' needs tis_cap > 0 (FlashRL, verl and TRL use 2), got {tis_cap}")
    # exp overflows to inf for a token the sampler found far less likely: the cap catches it.
    dtype = torch.promote_types(before.dtype, torch.float32)  # half-precision logprobs make coarse ratios
    return before, torch.exp(before.to(dtype) - sampler_logp.detach().to(dtype)).clamp(max=tis_cap)  # (B, T)


def batch_counts(mask):
    """(num_seqs, num_tokens) of a (B, T) mask: sequences with >= 1 masked token, masked tokens.

    Compute these on the FULL batch and pass them to every micro-batch's policy_loss call.
    """
    m = mask.bool()
    return int(m.any(dim=1).sum()), int(m.sum())


def policy_loss(logp, old_logp, advantages, mask, *, eps_low=0.2, eps_high=0.2, dual_clip=None,
                ref_logp=None, beta=0.0, agg="seq-mean-token-mean", num_seqs=None, num_tokens=None,
                const=None, entropy=None, is_weight=None, sampler_logp=None, tis_cap=None):
    """Clipped surrogate (times is_weight, + beta * k3 KL) aggregated by `agg`; returns (loss, metrics).

    logp (B, T) carries the gradient (half precision is computed in float32); old_logp, ref_logp,
    entropy (B, T) are treated as constants (detached); advantages (B,) or (B, T); mask (B, T) bool
    or 0/1. old_logp=None means on-policy (old = logp.detach(), ratio 1). See the module docstring
    for the aggregation modes and for num_seqs / num_tokens under gradient accumulation.

    metrics (floats, means over this call's masked tokens): loss, pg_loss, kl_loss (the two parts
    of loss), clip_frac_low, clip_frac_high, dual_clip_frac, ratio_mean, kl_old (k3 estimate of
    KL(pi_old || pi_theta) from the ratio: rho - 1 - log rho), kl_ref (k3 of KL(pi_theta || pi_ref),
    only when ref_logp is given), entropy (only when given), tokens and seqs (this call's counts).

    is_weight (B, T), detached, multiplies each token's policy-gradient term (TIS; None = 1).
    sampler_logp (B, T), only measured: mismatch_kl, mismatch_ratio_max (the largest pi_t / pi_s,
    0 on an empty mask) and, with tis_cap, tis_clip_frac, of logp against the sampler's logprobs (see
    the module docstring and sampler_correction).
    """
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    if logp.dim() != 2 or mask.shape != logp.shape:
        raise ValueError(f"logp and mask must both be (B, T); got {tuple(logp.shape)}, {tuple(mask.shape)}")
    if old_logp is None:
        old_logp = logp.detach()
    if old_logp.shape != logp.shape:
        raise ValueError(f"old_logp shape {tuple(old_logp.shape)} != logp shape {tuple(logp.shape)}")
    if beta != 0.0 and ref_logp is None:
        raise ValueError("beta != 0 needs ref_logp")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl uses 3), got {dual_clip}")
    if agg == "seq-sum-const" and (const is None or const <= 0):
        raise ValueError("agg='seq-sum-const' needs const > 0, e.g. the max generation length")

    if logp.dtype in (torch.float16, torch.bfloat16):
        # Ratios, counts and sums in half precision are too coarse (bf16 counts tokens exactly only
        # up to 256); the cast keeps the graph, so the gradient still reaches the half tensor.
        logp = logp.float()
    B, T = logp.shape
    m = mask.bool()  # (B, T)
    mf = m.to(logp.dtype)  # (B, T)
    if advantages.dim() == 1:
        if advantages.shape[0] != B:
            raise ValueError(f"advantages (B,) must have B={B}, got {tuple(advantages.shape)}")
        adv = advantages[:, None].expand(B, T)  # (B, T)
    elif advantages.shape == (B, T):
        adv = advantages
    else:
        raise ValueError(f"advantages must be (B,) or (B, T), got {tuple(advantages.shape)}")

    # Padding positions may hold anything (even inf); zero them before any exp so neither the loss
    # nor its gradient can pick up a NaN from a position the mask removes anyway.
    zero = logp.new_zeros(())
    lp = torch.where(m, logp, zero)  # (B, T)
    old = torch.where(m, old_logp.detach().to(logp.dtype), zero)  # (B, T)
    adv = torch.where(m, adv.detach().to(logp.dtype), zero)  # (B, T)

    log_ratio = lp - old  # (B, T)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = -adv * ratio  # (B, T)
    clipped = -adv * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)  # (B, T)
    pg = torch.maximum(unclipped, clipped)  # (B, T)  = -min(rho A, clip(rho) A)
    if dual_clip is not None:
        pg = torch.where(adv < 0, torch.minimum(pg, -dual_clip * adv), pg)  # (B, T)
    if is_weight is not None:
        if is_weight.shape != logp.shape:
            raise ValueError(f"is_weight shape {tuple(is_weight.shape)} != logp shape {tuple(logp.shape)}")
        pg = pg * torch.where(m, is_weight.detach().to(logp.dtype), zero)  # (B, T)

    if ref_logp is not None:
        ref = torch.where(m, ref_logp.detach().to(logp.dtype), zero)  # (B, T)
        kl = k3_kl(lp, ref)  # (B, T)
    else:
        kl = None

    # Counts stay tensors so that the loss needs no host sync; the metrics take one at the end.
    local_tokens = mf.sum()  # ()
    local_seqs = m.any(dim=1).sum().to(mf.dtype)  # ()
    # (the whole batch's counts are host numbers and stay so: a host tensor copied here would wait for the GPU)
    n_seqs = local_seqs.clamp(min=1.0) if num_seqs is None else max(1.0, float(num_seqs))
    n_tokens = local_tokens.clamp(min=1.0) if num_tokens is None else max(1.0, float(num_tokens))

    def aggregate(per_token):  # (B, T) -> scalar
        summed = (per_token * mf).sum(dim=1)  # (B,)
        if agg == "token-mean":
            return summed.sum() / n_tokens
        if agg == "seq-mean-token-mean":
            per_seq = summed / mf.sum(dim=1).clamp(min=1.0)  # (B,)  empty rows give 0
        else:  # seq-sum-const
            per_seq = summed / float(const)  # (B,)
        return per_seq.sum() / n_seqs

    pg_loss = aggregate(pg)
    kl_loss = beta * aggregate(kl) if (kl is not None and beta != 0.0) else pg_loss.new_zeros(())
    loss = pg_loss + kl_loss

    with torch.no_grad():
        denom = local_tokens.clamp(min=1.0)

        def masked_mean(x):  # (B, T) -> ()
            return (x.to(mf.dtype) * mf).sum() / denom

        r = ratio.detach()
        a = adv
        stats = {
            "loss": loss.detach(),
            "pg_loss": pg_loss.detach(),
            "kl_loss": kl_loss.detach(),
            "clip_frac_high": masked_mean((a > 0) & (r > 1.0 + eps_high)),
            "clip_frac_low": masked_mean((a < 0) & (r < 1.0 - eps_low)),
            "dual_clip_frac": masked_mean((a < 0) & (r > dual_clip)) if dual_clip is not None else zero,
            "ratio_mean": masked_mean(r),
            "kl_old": masked_mean(r - 1.0 - log_ratio.detach()),
            "tokens": local_tokens,
            "seqs": local_seqs,
        }
        if kl is not None:
            stats["kl_ref"] = masked_mean(kl.detach())
        if entropy is not None:
            stats["entropy"] = masked_mean(torch.where(m, entropy.detach().to(mf.dtype), zero))
        if sampler_logp is not None:
            if sampler_logp.shape != logp.shape:
                raise ValueError(f"sampler_logp shape {tuple(sampler_logp.shape)} != logp shape {tuple(logp.shape)}")
            x = lp.detach() - torch.where(m, sampler_logp.detach().to(mf.dtype), zero)  # (B, T) log pi_t/pi_s
            # (expm1 in float64: e^x - x - 1 of a mismatch ~1e-4 is ~1e-8, below float32's rounding of e^x)
            stats["mismatch_kl"] = masked_mean(torch.expm1(x.double()) - x.double())
            stats["mismatch_ratio_max"] = torch.where(m, torch.exp(x), zero).amax() if x.numel() else zero
            if tis_cap is not None:
                stats["tis_clip_frac"] = masked_mean(torch.exp(x) > tis_cap)
        # One device-to-host copy for all of them.
        values = torch.stack([v.to(mf.dtype) for v in stats.values()]).tolist()
        metrics = dict(zip(stats.keys(), values))
    return loss, metrics


def add_metrics(sums, metrics, num_tokens):
    """Add a micro-batch's policy_loss metrics into the batch's `sums`: the loss parts already add up across
    micro-batches (their divisors are the batch's counts), per-token means are weighted by the micro-batch's
    share of the batch's `num_tokens`, and a *_max is the largest of the micro-batches'."""
    w = metrics["tokens"] / max(1, num_tokens)
    for k, v in metrics.items():
        if k.endswith("_max"):
            sums[k] = max(sums.get(k, v), v)
        elif k not in ("tokens", "seqs"):
            sums[k] = sums.get(k, 0.0) + (v if k in ("loss", "pg_loss", "kl_loss") else v * w)
