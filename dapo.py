"""DAPO: GRPO with clip-higher, a token-level loss, dynamic sampling and overlong shaping.

DAPO (Yu et al. 2025, arXiv 2503.14476, "Decoupled Clip and Dynamic sAmpling Policy Optimization")
keeps GRPO's group-relative advantages (grpo.group_advantages) and changes four things (§3):

1. Clip-higher (§3.1). The symmetric clip [1 - eps, 1 + eps] caps how much a token's probability can
   grow in one step in RELATIVE terms, so an unlikely token (p = 0.01) can only reach 0.012: the
   clip starves exploration and entropy collapses. DAPO decouples the bounds and raises the upper
   one: eps_low = 0.2, eps_high = 0.28.

2. Dynamic sampling (§3.2). A group whose G rewards are all equal has all advantages 0 and gives no
   gradient, yet still counts in the batch (a shrinking effective batch as accuracy rises). DAPO
   over-samples prompts, drops such groups, and keeps sampling until the batch holds the wanted
   number of informative groups:  0 < |{o_i : correct}| < G.

       informative_groups(rewards)               (num_groups, G) -> (num_groups,) bool

   The rounds themselves are train.py's loop (sample, reward, filter, until the step holds --prompts
   informative groups or --max-sampling-rounds have run), kept there so that a reader sees them.

3. Token-level policy gradient loss (§3.3). GRPO averages tokens within a sequence, then averages
   sequences, so a token of a long completion weighs less than one of a short completion: long
   rambling or repetitive answers are punished too weakly. DAPO averages over all tokens of the batch:

       L = 1 / sum_i |o_i|  *  sum_i sum_t l_it               grpo's agg="token-mean"

   With gradient accumulation the divisor is the token count of the whole batch, passed as
   num_tokens (see grpo.py).

4. Overlong reward shaping (§3.4). Truncated completions are not necessarily wrong, so punishing
   them with the "wrong answer" reward is noise. Two remedies:
   - overlong filtering: mask the loss of truncated samples (overlong_filter_mask /
     apply_overlong_filter);
   - soft overlong punishment, added to the task reward (eq. 13), with L_max the generation budget
     and L_cache the width of the soft band:

       R_length(y) =  0                                  |y| <= L_max - L_cache
                      ((L_max - L_cache) - |y|) / L_cache   L_max - L_cache < |y| <= L_max
                      -1                                 L_max < |y|

     (continuous: -1 exactly at |y| = L_max, so a sampler capped at L_max never sees the third case.)

And no KL term (§2.3): with long chain-of-thought the policy is meant to drift far from the initial
model, so beta = 0 and no reference forward is needed.

What is kept and what is not, and why:
- Kept: all four techniques and beta = 0, with the paper's defaults (0.2 / 0.28, token-mean).
- Dynamic sampling in train.py PROCEEDS with what it has after --max-sampling-rounds and says that it
  fell short; the paper just keeps sampling and verl's DAPO recipe raises an
  error after its maximum number of generation batches. For a small single-GPU run, training on a
  slightly smaller batch beats crashing or looping forever on a task that became too easy/hard.
- The filter looks at whatever rewards the caller passes. The paper's rewards are ±1 correctness;
  once the overlong penalty is added, two completions with equal correctness but different lengths
  differ, so pass the correctness rewards if you want the paper's filter ("acc" in verl's recipe).
- Overlong filtering only masks the loss; the truncated samples still count in their group's mean
  and std (the advantages are computed before the mask is applied), as in the paper and as TRL's
  mask_truncated_completions does.
- The two remedies overlap: with the filter on, a truncated sample's -1 penalty never reaches its own
  tokens, and only lowers its group's mean (raising its siblings' advantages); the soft band then
  acts on the completions that stopped inside it. The official QeRL scripts use the filter alone
  (mask_truncated_completions, no length term in the reward), and so does train.py's paper recipe;
  the soft punishment stays available (--overlong-buffer) and is the tiny demo's default.
- Not kept: the paper's rule-based ±1 reward and its data (DAPO-Math-17K) belong to the task code;
  the dual clip (verl's, not DAPO's) is available through grpo.policy_loss's dual_clip, off here.
Pure torch plus grpo.py; tested alone in tests/test_dapo.py.
"""
import torch

import grpo

EPS_LOW = 0.2
EPS_HIGH = 0.28


def policy_loss(logp, old_logp, advantages, mask, *, eps_low=EPS_LOW, eps_high=EPS_HIGH, agg="token-mean",
                beta=0.0, **kwargs):
    """grpo.policy_loss with DAPO's defaults: clip-higher (0.2, 0.28), token-mean, no KL."""
    return grpo.policy_loss(logp, old_logp, advantages, mask, eps_low=eps_low, eps_high=eps_high, agg=agg,
                            beta=beta, **kwargs)


def informative_groups(rewards):
    """(num_groups, G) rewards -> (num_groups,) bool: True where the group's rewards are not all equal."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be (num_groups, G), got shape {tuple(rewards.shape)}")
    if rewards.shape[1] == 0:
        return torch.zeros(rewards.shape[0], dtype=torch.bool, device=rewards.device)
    return rewards.amax(dim=1) != rewards.amin(dim=1)


def overlong_penalty(lengths, max_len, cache_len, dtype=None):
    """Soft overlong punishment (DAPO eq. 13) per completion length; (B,) ints -> (B,) floats in [-1, 0].

    cache_len = 0 degenerates to the hard rule: 0 up to max_len, -1 beyond.
    """
    if not 0 <= cache_len <= max_len:
        raise ValueError(f"need 0 <= cache_len <= max_len, got cache_len={cache_len}, max_len={max_len}")
    lengths = torch.as_tensor(lengths)
    dtype = dtype or torch.get_default_dtype()
    n = lengths.to(dtype)  # (B,)
    start = float(max_len - cache_len)  # the soft band is (start, max_len]
    if cache_len > 0:
        soft = (start - n) / float(cache_len)  # (B,)
    else:
        soft = torch.zeros_like(n)  # the band is empty; the value is never selected
    return torch.where(n <= start, torch.zeros_like(n), torch.where(n <= max_len, soft, -torch.ones_like(n)))


def overlong_filter_mask(truncated):
    """(B,) bool truncated flags (finish reason "length") -> (B,) bool: True for samples to keep."""
    return ~torch.as_tensor(truncated, dtype=torch.bool)


def apply_overlong_filter(mask, truncated):
    """Zero the (B, T) loss mask on truncated samples (overlong filtering); keeps the mask's dtype."""
    keep = overlong_filter_mask(truncated).to(mask.device)  # (B,)
    return mask * keep[:, None].to(mask.dtype) if mask.dtype != torch.bool else mask & keep[:, None]
