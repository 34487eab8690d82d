"""grpo.py: hand-computed cases, a plain-Python float64 reference of the published formulas, the
gradient's sign, where clipping kills the gradient, micro-batch accumulation for every agg mode, and the
three ratio modes (trainer, sampler, tis) with their mismatch metrics against formulas written here."""

import math
import statistics
import sys
import warnings
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import grpo  # noqa: E402

F64 = torch.float64
TOL = 1e-10


# ---------------------------------------------------------------- independent references (plain Python)

def ref_advantages(rewards, eps, std):
    """DeepSeekMath §4.1.2 on nested lists, with the statistics module's sample std."""
    flat = [r for group in rewards for r in group]
    out = []
    for group in rewards:
        if len(group) < 2:
            out.append([0.0] * len(group))
            continue
        mu = statistics.fmean(group)
        if std == "group":
            scale = statistics.stdev(group) + eps
        elif std == "batch":
            scale = statistics.stdev(flat) + eps
        else:
            scale = 1.0
        out.append([(r - mu) / scale for r in group])
    return out


def ref_policy_loss(logp, old, adv, mask, ref, *, eps_low, eps_high, dual_clip, beta, agg, num_seqs,
                    num_tokens, const):
    """GRPO eq. 3 (negated) token by token, with its analytic gradient d loss / d logp.

    adv is a per-token nested list. num_seqs / num_tokens None means this batch's own counts.
    Returns (loss, grad, metrics).
    """
    B = len(logp)
    lengths = [sum(1 for t in range(len(logp[b])) if mask[b][t]) for b in range(B)]
    S = num_seqs if num_seqs is not None else sum(1 for n in lengths if n > 0)
    N = num_tokens if num_tokens is not None else sum(lengths)
    loss = 0.0
    grad = [[0.0] * len(row) for row in logp]
    counts = dict(high=0, low=0, dual=0)
    sums = dict(ratio=0.0, kl_old=0.0, kl_ref=0.0)
    for b in range(B):
        if lengths[b] == 0:
            continue
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            a = adv[b][t]
            rho = math.exp(logp[b][t] - old[b][t])
            clipped_rho = min(max(rho, 1 - eps_low), 1 + eps_high)
            objective = min(rho * a, clipped_rho * a)
            token_loss = -objective
            # d(-rho a)/dlogp = -rho a when the unclipped term is the min; a constant otherwise.
            # (A tie means rho is inside the clip range, where both terms carry the same gradient.)
            dtoken = -rho * a if rho * a <= clipped_rho * a else 0.0
            if a > 0 and rho > 1 + eps_high:
                counts["high"] += 1
            if a < 0 and rho < 1 - eps_low:
                counts["low"] += 1
            if dual_clip is not None and a < 0 and token_loss > -dual_clip * a:
                token_loss, dtoken = -dual_clip * a, 0.0
                counts["dual"] += 1
            sums["ratio"] += rho
            sums["kl_old"] += rho - 1 - math.log(rho)
            if ref is not None:
                d = ref[b][t] - logp[b][t]
                k3 = math.exp(d) - d - 1
                sums["kl_ref"] += k3
                token_loss += beta * k3
                dtoken += beta * (1 - math.exp(d))
            if agg == "token-mean":
                w = 1.0 / N
            elif agg == "seq-mean-token-mean":
                w = 1.0 / (S * lengths[b])
            else:
                w = 1.0 / (S * const)
            loss += w * token_loss
            grad[b][t] = w * dtoken
    n_local = sum(lengths)
    metrics = {"clip_frac_high": counts["high"] / n_local, "clip_frac_low": counts["low"] / n_local,
               "dual_clip_frac": counts["dual"] / n_local, "ratio_mean": sums["ratio"] / n_local,
               "kl_old": sums["kl_old"] / n_local}
    if ref is not None:
        metrics["kl_ref"] = sums["kl_ref"] / n_local
    return loss, grad, metrics


# ---------------------------------------------------------------- helpers

def random_batch(gen, B, T, *, spread=0.6, empty_row=True, per_token_adv=False):
    """float64 tensors with uneven masks (completion lengths 0..T, right padding full of garbage)."""
    logp = -torch.rand(B, T, generator=gen, dtype=F64) * 3  # (B, T)
    old = logp + torch.randn(B, T, generator=gen, dtype=F64) * spread  # ratios from ~0.2 to ~5
    ref = logp + torch.randn(B, T, generator=gen, dtype=F64) * 0.5
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    if empty_row:
        lengths[B // 2] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    # Padding holds junk a real batch may hold; the loss must ignore it entirely.
    logp = torch.where(mask, logp, torch.full_like(logp, -1e4))
    old = torch.where(mask, old, torch.full_like(old, float("nan")))
    adv_shape = (B, T) if per_token_adv else (B,)
    adv = torch.randn(adv_shape, generator=gen, dtype=F64)
    entropy = torch.rand(B, T, generator=gen, dtype=F64)
    return logp, old, ref, adv, mask, entropy


def seed_of(*parts):
    """A fixed seed per parametrisation (str hash() changes between interpreter runs)."""
    return zlib.crc32(repr(parts).encode())


def per_token(adv, T):
    return adv[:, None].expand(-1, T) if adv.dim() == 1 else adv


def run_loss(logp, *args, **kwargs):
    """policy_loss with a fresh leaf for logp; returns (loss, grad, metrics)."""
    x = logp.clone().requires_grad_(True)
    loss, metrics = grpo.policy_loss(x, *args, **kwargs)
    loss.backward()
    return loss, x.grad, metrics


# ---------------------------------------------------------------- group advantages

def test_group_advantages_hand_computed():
    eps = 1e-6
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]], dtype=F64)
    got = grpo.group_advantages(rewards, eps=eps)
    # group 0: mean 1/2, sample var (4 * 1/4) / 3 = 1/3; group 1: no spread -> 0;
    # group 2: mean 3/4, deviations (-3/4, -3/4, -3/4, 9/4), sample var (3 * 9/16 + 81/16) / 3 = 9/4 -> std 3/2.
    s0 = math.sqrt(1 / 3) + eps
    want = torch.tensor([[0.5 / s0, -0.5 / s0, -0.5 / s0, 0.5 / s0], [0.0] * 4,
                         [-0.75 / (1.5 + eps)] * 3 + [2.25 / (1.5 + eps)]], dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)

    two = torch.tensor([[0.0, 2.0], [1.0, 1.0]], dtype=F64)
    # batch: all four rewards (0, 2, 1, 1) have mean 1 and sample var 2/3; group centring gives ±1 and 0.
    torch.testing.assert_close(grpo.group_advantages(two, eps=0.0, std="batch"),
                               torch.tensor([[-1.0, 1.0], [0.0, 0.0]], dtype=F64) / math.sqrt(2 / 3))
    torch.testing.assert_close(grpo.group_advantages(two, std="none"),
                               torch.tensor([[-1.0, 1.0], [0.0, 0.0]], dtype=F64))


def test_group_advantages_groups_of_one_and_integer_rewards():
    for std in grpo.STD_MODES:
        out = grpo.group_advantages(torch.tensor([[3.0], [-1.0], [0.5]]), std=std)
        assert out.shape == (3, 1) and torch.equal(out, torch.zeros(3, 1))
        with warnings.catch_warnings():  # no groups (all filtered out): empty, without the std's warning
            warnings.simplefilter("error")
            assert grpo.group_advantages(torch.zeros(0, 4), std=std).shape == (0, 4)
    ints = grpo.group_advantages(torch.tensor([[1, 0, 0], [1, 1, 1]]))
    assert ints.is_floating_point() and ints[0, 0] > 0 > ints[0, 1] and torch.equal(ints[1], torch.zeros(3))
    with pytest.raises(ValueError):
        grpo.group_advantages(torch.zeros(2, 3), std="max")
    with pytest.raises(ValueError):
        grpo.group_advantages(torch.zeros(6))


@pytest.mark.parametrize("std", grpo.STD_MODES)
@pytest.mark.parametrize("shape,binary", [((7, 5), True), ((3, 16), False), ((1, 9), False), ((11, 2), True)])
def test_group_advantages_match_reference(std, shape, binary):
    gen = torch.Generator().manual_seed(seed_of((std, shape, binary)))
    if binary:  # correctness rewards: ties and all-equal groups are common
        rewards = torch.randint(0, 2, shape, generator=gen).to(F64)
        rewards[0] = 1.0  # at least one group with no spread
    else:
        rewards = torch.randn(shape, generator=gen, dtype=F64) * 3 + 1
    got = grpo.group_advantages(rewards, eps=1e-4, std=std)
    want = torch.tensor(ref_advantages(rewards.tolist(), 1e-4, std), dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    # Centred within each group whatever the scale.
    assert got.sum(dim=1).abs().max() < 1e-10


# ---------------------------------------------------------------- the loss on a hand-computed case

def hand_batch():
    """Two sequences; ratios chosen so that each clip region appears once (see the comments)."""
    ratios = torch.tensor([[1.5, 0.5, 1.0], [0.5, 4.0, 1.0]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -3.0, -1.0]], dtype=F64)
    logp = old + ratios.log()
    logp[1, 2] = float("inf")  # padding garbage: must not leak into the loss or the gradient
    adv = torch.tensor([1.0, -2.0], dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    return logp, old, adv, mask


@pytest.mark.parametrize("agg,dual,want", [
    # Token losses, eps 0.2: seq 0 (A = +1): rho 1.5 -> clipped -1.2; rho 0.5 -> -0.5; rho 1 -> -1
    #   (sum -2.7 over 3 tokens). seq 1 (A = -2): rho 0.5 -> clipped -(0.8 * -2) = 1.6; rho 4 -> 8,
    #   or with the dual clip c = 3: min(8, 3 * 2) = 6 (sum 9.6, or 7.6, over 2 tokens).
    ("seq-mean-token-mean", None, (-2.7 / 3 + 9.6 / 2) / 2),
    ("seq-mean-token-mean", 3.0, (-2.7 / 3 + 7.6 / 2) / 2),
    ("token-mean", None, (-2.7 + 9.6) / 5),
    ("token-mean", 3.0, (-2.7 + 7.6) / 5),
    ("seq-sum-const", None, (-2.7 / 4 + 9.6 / 4) / 2),
    ("seq-sum-const", 3.0, (-2.7 / 4 + 7.6 / 4) / 2),
])
def test_policy_loss_hand_computed(agg, dual, want):
    logp, old, adv, mask = hand_batch()
    loss, grad, m = run_loss(logp, old, adv, mask, dual_clip=dual, agg=agg, const=4)
    assert abs(loss.item() - want) < 1e-12
    assert torch.isfinite(grad).all() and grad[1, 2] == 0
    # Zero gradient on the two clipped tokens (and the dual-clipped one), -A rho w elsewhere.
    w = {"seq-mean-token-mean": [1 / 6, 1 / 4], "token-mean": [1 / 5, 1 / 5], "seq-sum-const": [1 / 8, 1 / 8]}[agg]
    want_grad = torch.tensor([[0.0, -0.5 * w[0], -1.0 * w[0]],
                              [0.0, 0.0 if dual else 8.0 * w[1], 0.0]], dtype=F64)
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=1e-12)
    assert m["clip_frac_high"] == pytest.approx(1 / 5) and m["clip_frac_low"] == pytest.approx(1 / 5)
    assert m["dual_clip_frac"] == pytest.approx(1 / 5 if dual else 0.0)
    assert m["ratio_mean"] == pytest.approx((1.5 + 0.5 + 1.0 + 0.5 + 4.0) / 5)
    kl_old = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.0, 0.5, 4.0)) / 5
    assert m["kl_old"] == pytest.approx(kl_old) and "kl_ref" not in m
    assert m["tokens"] == 5 and m["seqs"] == 2 and m["loss"] == pytest.approx(want)


def test_k3_kl_term_hand_computed():
    # One sequence, ratio 1 and A = 0: only the KL acts. ref - logp = (ln 2, 0): k3 = (2 - ln 2 - 1, 0).
    logp = torch.tensor([[-1.0, -2.0]], dtype=F64)
    ref = logp + torch.tensor([[math.log(2.0), 0.0]], dtype=F64)
    beta = 0.04
    loss, grad, m = run_loss(logp, logp, torch.zeros(1, dtype=F64), torch.ones(1, 2), ref_logp=ref, beta=beta)
    assert abs(loss.item() - beta * (1 - math.log(2)) / 2) < 1e-14
    # d k3 / d logp = 1 - e^(ref - logp) = -1 on token 0: descending raises logp towards the reference.
    torch.testing.assert_close(grad, torch.tensor([[-beta / 2, 0.0]], dtype=F64), rtol=0, atol=1e-14)
    assert m["kl_ref"] == pytest.approx((1 - math.log(2)) / 2) and m["kl_loss"] == pytest.approx(loss.item())
    assert m["pg_loss"] == 0.0


def test_k3_is_nonnegative_and_matches_formula():
    gen = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(2, 5, 7, generator=gen, dtype=F64).unbind(0)
    got = grpo.k3_kl(logp, ref)
    want = torch.tensor([[math.exp(r - l) - (r - l) - 1 for l, r in zip(lr, rr)]
                         for lr, rr in zip(logp.tolist(), ref.tolist())], dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    assert (got >= 0).all() and torch.equal(grpo.k3_kl(logp, logp), torch.zeros_like(logp))


# ---------------------------------------------------------------- gradient: sign and clipping

def test_gradient_sign_and_descent_direction():
    gen = torch.Generator().manual_seed(1)
    B, T = 6, 9
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 4
    logp = old + (torch.rand(B, T, generator=gen, dtype=F64) - 0.5) * 0.2  # ratios inside the clip range
    adv = torch.tensor([1.0, -1.0, 0.5, -0.25, 2.0, -3.0], dtype=F64)
    mask = torch.ones(B, T)
    for agg in grpo.AGG_MODES:
        loss, grad, _ = run_loss(logp, old, adv, mask, agg=agg, const=T)
        assert (grad[adv > 0] < 0).all() and (grad[adv < 0] > 0).all()
        # Raising the logprob of one positive-advantage token lowers the loss; of a negative one raises it.
        for b, sign in ((0, -1), (1, +1)):
            bumped = logp.clone()
            bumped[b, 3] += 1e-4
            new_loss, _ = grpo.policy_loss(bumped, old, adv, mask, agg=agg, const=T)
            assert sign * (new_loss.item() - loss.item()) > 0


@pytest.mark.parametrize("dual", [None, 3.0])
def test_clipping_kills_gradient_exactly_where_it_should(dual):
    eps_low, eps_high = 0.2, 0.28
    # Every ratio region crossed with both advantage signs and zero; values stay off the boundaries.
    rhos = torch.tensor([0.3, 0.79, 0.81, 1.0, 1.27, 1.29, 2.0, 2.99, 3.01, 6.0], dtype=F64)
    advs = torch.tensor([1.5, -0.7, 0.0], dtype=F64)
    T = len(rhos)
    old = torch.full((3, T), -1.3, dtype=F64)
    logp = old + rhos.log()[None, :]
    mask = torch.ones(3, T, dtype=torch.bool)
    mask[0, 4] = False  # a masked token inside the trust region: no gradient either
    _, grad, m = run_loss(logp, old, advs, mask, eps_low=eps_low, eps_high=eps_high, dual_clip=dual,
                          agg="token-mean")
    a = advs[:, None].expand(3, T)
    r = rhos[None, :].expand(3, T)
    high = (a > 0) & (r > 1 + eps_high)
    low = (a < 0) & (r < 1 - eps_low)
    dual_cut = (a < 0) & (r > dual) if dual else torch.zeros_like(high)
    dead = high | low | dual_cut | (a == 0) | ~mask
    assert torch.equal(grad == 0, dead)
    n = mask.sum().item()
    assert m["clip_frac_high"] == pytest.approx((high & mask).sum().item() / n)
    assert m["clip_frac_low"] == pytest.approx((low & mask).sum().item() / n)
    assert m["dual_clip_frac"] == pytest.approx((dual_cut & mask).sum().item() / n)
    assert (high & mask).any() and (low & mask).any() and (dual is None or dual_cut.any())


# ---------------------------------------------------------------- agreement with the reference on random inputs

@pytest.mark.parametrize("agg", grpo.AGG_MODES)
@pytest.mark.parametrize("dual", [None, 3.0])
@pytest.mark.parametrize("with_ref", [False, True])
@pytest.mark.parametrize("shape,per_token_adv", [((5, 7), False), ((8, 13), True), ((3, 1), False)])
def test_policy_loss_matches_reference(agg, dual, with_ref, shape, per_token_adv):
    gen = torch.Generator().manual_seed(seed_of((agg, dual, with_ref, shape)))
    B, T = shape
    logp, old, ref, adv, mask, entropy = random_batch(gen, B, T, per_token_adv=per_token_adv)
    kw = dict(eps_low=0.2, eps_high=0.28, dual_clip=dual, beta=0.04 if with_ref else 0.0, agg=agg, const=17)
    loss, grad, m = run_loss(logp, old, adv, mask, ref_logp=ref if with_ref else None, entropy=entropy, **kw)
    kw.pop("const")
    want_loss, want_grad, want_m = ref_policy_loss(
        logp.tolist(), old.tolist(), per_token(adv, T).tolist(), mask.tolist(),
        ref.tolist() if with_ref else None, num_seqs=None, num_tokens=None, const=17, **kw)
    assert abs(loss.item() - want_loss) <= TOL
    torch.testing.assert_close(grad, torch.tensor(want_grad, dtype=F64), rtol=0, atol=TOL)
    for key, value in want_m.items():
        assert abs(m[key] - value) <= TOL, key
    assert ("kl_ref" in m) == with_ref
    kept = [e for e, k in zip(entropy.flatten().tolist(), mask.flatten().tolist()) if k]
    assert abs(m["entropy"] - sum(kept) / len(kept)) <= TOL


# ---------------------------------------------------------------- gradient accumulation

@pytest.mark.parametrize("agg", grpo.AGG_MODES)
def test_microbatches_add_up_to_the_full_batch(agg):
    gen = torch.Generator().manual_seed(seed_of(agg))
    B, T = 11, 19
    logp, old, ref, adv, mask, _ = random_batch(gen, B, T, spread=0.5)
    mask[2] = False  # a second empty sequence, in another micro-batch than the first
    kw = dict(ref_logp=ref, beta=0.04, dual_clip=3.0, eps_low=0.2, eps_high=0.28, agg=agg, const=T)
    full_loss, full_grad, _ = run_loss(logp, old, adv, mask, **kw)
    num_seqs, num_tokens = grpo.batch_counts(mask)
    assert num_seqs == B - 2 and num_tokens == mask.sum().item()

    x = logp.clone().requires_grad_(True)
    total, naive = 0.0, []
    for rows in (slice(0, 1), slice(1, 5), slice(5, 11)):  # uneven micro-batches
        width = int(mask[rows].sum(dim=1).max().clamp(min=1))  # each micro-batch trimmed to its own padding
        cols = slice(0, width)
        args = (x[rows, cols], old[rows, cols], adv[rows], mask[rows, cols])
        micro_kw = dict(kw, ref_logp=ref[rows, cols])
        loss, _ = grpo.policy_loss(*args, num_seqs=num_seqs, num_tokens=num_tokens, **micro_kw)
        loss.backward()
        total = total + loss.item()
        naive.append(grpo.policy_loss(*args, **micro_kw)[0].item())
    assert abs(total - full_loss.item()) <= TOL
    torch.testing.assert_close(x.grad, full_grad, rtol=0, atol=TOL)
    # The classic bug, averaging each micro-batch's own mean, gives another number: the test can tell.
    assert abs(sum(naive) / len(naive) - full_loss.item()) > 1e-6


def test_counts_default_to_the_call_and_empty_mask_is_safe():
    gen = torch.Generator().manual_seed(3)
    logp, old, ref, adv, mask, _ = random_batch(gen, 4, 6)
    num_seqs, num_tokens = grpo.batch_counts(mask)
    for agg in grpo.AGG_MODES:
        a, _ = grpo.policy_loss(logp, old, adv, mask, agg=agg, const=6)
        b, _ = grpo.policy_loss(logp, old, adv, mask, agg=agg, const=6, num_seqs=num_seqs, num_tokens=num_tokens)
        assert a.item() == b.item()
        x = logp.clone().requires_grad_(True)
        loss, m = grpo.policy_loss(x, old, adv, torch.zeros_like(mask), agg=agg, const=6)
        loss.backward()
        assert loss.item() == 0.0 and torch.equal(x.grad, torch.zeros_like(x)) and m["tokens"] == 0


def test_on_policy_default_and_validation():
    gen = torch.Generator().manual_seed(4)
    logp, _, ref, adv, mask, _ = random_batch(gen, 3, 5, empty_row=False)
    loss, grad, m = run_loss(logp, None, adv, mask)
    assert m["ratio_mean"] == pytest.approx(1.0) and m["clip_frac_high"] == m["clip_frac_low"] == 0.0
    # On-policy, seq-mean-token-mean: loss = -mean over sequences of A, gradient -A / (S |o_b|).
    lengths = mask.sum(dim=1).to(F64)
    assert loss.item() == pytest.approx(-adv.mean().item())
    torch.testing.assert_close(grad, torch.where(mask, -(adv / (3 * lengths))[:, None], 0.0).to(F64))
    bad = [dict(agg="sum"), dict(beta=0.1), dict(agg="seq-sum-const"), dict(dual_clip=1.0)]
    for kw in bad:
        with pytest.raises(ValueError):
            grpo.policy_loss(logp, logp, adv, mask, **kw)
    with pytest.raises(ValueError):
        grpo.policy_loss(logp, logp, adv[:2], mask)
    with pytest.raises(ValueError):
        grpo.policy_loss(logp, logp[:, :4], adv, mask)


# ---------------------------------------------------------------- the ratio: against the sampler or the trainer

def ref_ratio_modes(mode, logp, sampler, adv, mask, *, eps_low, eps_high, cap, beta=0.0, ref=None):
    """token-mean loss and gradient for one pass, written from the definitions in plain Python floats:
    trainer: rho = 1 (old = the trainer's own logp, detached), its gradient -A per token;
    sampler: rho = pi_t / pi_s, the PPO clip on it; tis: rho = 1 for the clip, times the constant
    w = min(pi_t / pi_s, cap). Also the mismatch metrics against the sampler."""
    N = sum(1 for row in mask for k in row if k)
    loss, grad = 0.0, [[0.0] * len(row) for row in logp]
    kl = ratio_max = over_cap = 0.0
    for b in range(len(logp)):
        for t in range(len(logp[b])):
            if not mask[b][t]:
                continue
            a, lt, ls = adv[b][t], logp[b][t], sampler[b][t]
            r_ts = math.exp(lt - ls)  # pi_t / pi_s
            kl += r_ts - (lt - ls) - 1
            ratio_max = max(ratio_max, r_ts)
            over_cap += r_ts > cap
            if mode == "sampler":
                rho = r_ts
                clipped = min(max(rho, 1 - eps_low), 1 + eps_high)
                token = -min(rho * a, clipped * a)
                dtoken = -rho * a if rho * a <= clipped * a else 0.0
            else:
                w = 1.0 if mode == "trainer" else min(r_ts, cap)
                token, dtoken = -w * a, -w * a  # rho = 1 sits inside the clip range: never clipped
            if ref is not None:
                d = ref[b][t] - lt
                token += beta * (math.exp(d) - d - 1)
                dtoken += beta * (1 - math.exp(d))
            loss += token / N
            grad[b][t] = dtoken / N
    return loss, grad, {"mismatch_kl": kl / N, "mismatch_ratio_max": ratio_max, "tis_clip_frac": over_cap / N}


@pytest.mark.parametrize("mode", grpo.RATIO_MODES)
@pytest.mark.parametrize("shape,with_ref", [((5, 7), False), ((4, 11), True), ((2, 1), False)])
def test_ratio_modes_match_their_formulas(mode, shape, with_ref):
    gen = torch.Generator().manual_seed(seed_of(mode, shape, with_ref))
    B, T = shape
    logp, sampler, ref, adv, mask, _ = random_batch(gen, B, T, spread=0.8)  # sampler: NaN in the padding
    cap = 1.7
    x = logp.clone().requires_grad_(True)
    old, w = grpo.sampler_correction(mode, x, sampler, tis_cap=cap)
    assert (w is None) == (mode != "tis") and (mode == "sampler" or not old.requires_grad)
    beta = 0.04 if with_ref else 0.0
    loss, m = grpo.policy_loss(x, old, adv, mask, eps_low=0.2, eps_high=0.28, agg="token-mean", is_weight=w,
                               sampler_logp=sampler, tis_cap=cap, ref_logp=ref if with_ref else None, beta=beta)
    loss.backward()
    want_loss, want_grad, want_m = ref_ratio_modes(mode, logp.tolist(), sampler.tolist(), per_token(adv, T).tolist(),
                                                   mask.tolist(), eps_low=0.2, eps_high=0.28, cap=cap, beta=beta,
                                                   ref=ref.tolist() if with_ref else None)
    assert abs(loss.item() - want_loss) <= TOL
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=F64), rtol=0, atol=TOL)
    for key, value in want_m.items():
        assert abs(m[key] - value) <= TOL, key
    if mode != "sampler":  # the ratio is exactly 1: nothing is clipped
        assert m["ratio_mean"] == 1.0 and m["clip_frac_high"] == m["clip_frac_low"] == 0.0


def test_the_three_modes_differ_and_tis_needs_a_cap():
    gen = torch.Generator().manual_seed(9)
    logp, sampler, _, adv, mask, _ = random_batch(gen, 6, 9, spread=0.8, empty_row=False)
    losses = {}
    for mode in grpo.RATIO_MODES:
        old, w = grpo.sampler_correction(mode, logp, sampler, tis_cap=2.0)
        losses[mode] = grpo.policy_loss(logp, old, adv, mask, is_weight=w, agg="token-mean")[0].item()
    assert len({round(v, 9) for v in losses.values()}) == 3
    # A second pass: "trainer" takes the first pass's logp, not the current one.
    before = logp - 0.1
    old, _ = grpo.sampler_correction("trainer", logp, sampler, trainer_logp=before)
    assert torch.equal(old, before)
    for cap in (None, 0.0):
        with pytest.raises(ValueError, match="tis_cap"):
            grpo.sampler_correction("tis", logp, sampler, tis_cap=cap)
    with pytest.raises(ValueError, match="ratio mode"):
        grpo.sampler_correction("vllm", logp, sampler)
    with pytest.raises(ValueError, match="is_weight"):
        grpo.policy_loss(logp, logp, adv, mask, is_weight=logp[:, :3])


def test_micro_batch_metrics_add_up_to_the_batchs():
    """add_metrics over micro-batches: loss parts summed, per-token means weighted by tokens, maxima the
    largest; the counts themselves dropped."""
    sums = {}
    grpo.add_metrics(sums, {"loss": 0.5, "clip_frac": 0.2, "ratio_max": 1.5, "tokens": 30, "seqs": 2}, 40)
    grpo.add_metrics(sums, {"loss": 0.25, "clip_frac": 0.6, "ratio_max": 1.2, "tokens": 10, "seqs": 1}, 40)
    assert sums == pytest.approx({"loss": 0.75, "clip_frac": 0.2 * 0.75 + 0.6 * 0.25, "ratio_max": 1.5})
