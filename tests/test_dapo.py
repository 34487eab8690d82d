"""dapo.py: the DAPO defaults against a plain-Python reference of the paper's objective, clip-higher,
the informative-group test of dynamic sampling (its rounds are train.py's loop: tests/test_train.py),
the soft overlong punishment and overlong filtering."""

import math
import sys
import zlib
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import dapo  # noqa: E402
import grpo  # noqa: E402

F64 = torch.float64
TOL = 1e-10


def seed_of(*parts):
    return zlib.crc32(repr(parts).encode())


# ---------------------------------------------------------------- independent references (plain Python)

def ref_dapo_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, num_tokens=None):
    """DAPO eq. 8, negated: -1/sum|o_i| sum_i sum_t min(r A, clip(r, 1-eps_low, 1+eps_high) A), with
    d loss/d logp written by cases (zero exactly where the clipped term is the smaller one)."""
    total = num_tokens if num_tokens is not None else sum(sum(1 for k in row if k) for row in mask)
    loss, grad = 0.0, [[0.0] * len(row) for row in logp]
    for b, row in enumerate(logp):
        for t, lp in enumerate(row):
            if not mask[b][t]:
                continue
            r, a = math.exp(lp - old[b][t]), adv[b]
            clipped = (a > 0 and r > 1 + eps_high) or (a < 0 and r < 1 - eps_low)
            bounded = 1 + eps_high if r > 1 + eps_high else (1 - eps_low if r < 1 - eps_low else r)
            loss -= min(r * a, bounded * a) / total
            grad[b][t] = 0.0 if clipped else -a * r / total
    return loss, grad


def ref_overlong(length, max_len, cache_len):
    """DAPO eq. 13, case by case."""
    if length <= max_len - cache_len:
        return 0.0
    if length <= max_len:
        return ((max_len - cache_len) - length) / cache_len
    return -1.0


# ---------------------------------------------------------------- the loss

def random_batch(gen, B, T):
    old = -torch.rand(B, T, generator=gen, dtype=F64) * 3  # (B, T)
    logp = old + torch.randn(B, T, generator=gen, dtype=F64) * 0.4
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    adv = torch.randn(B, generator=gen, dtype=F64)
    return logp, old, adv, mask


@pytest.mark.parametrize("shape", [(4, 9), (9, 5), (1, 31)])
def test_dapo_loss_matches_reference(shape):
    gen = torch.Generator().manual_seed(seed_of(shape))
    logp, old, adv, mask = random_batch(gen, *shape)
    x = logp.clone().requires_grad_(True)
    loss, m = dapo.policy_loss(x, old, adv, mask)
    loss.backward()
    want_loss, want_grad = ref_dapo_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist())
    assert abs(loss.item() - want_loss) <= TOL
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=F64), rtol=0, atol=TOL)
    assert m["kl_loss"] == 0.0 and m["dual_clip_frac"] == 0.0
    # Same thing as grpo's loss with the DAPO knobs spelled out.
    same, _ = grpo.policy_loss(logp, old, adv, mask, eps_low=0.2, eps_high=0.28, agg="token-mean")
    assert same.item() == loss.item()


def test_dapo_loss_accumulates_over_microbatches():
    gen = torch.Generator().manual_seed(7)
    logp, old, adv, mask = random_batch(gen, 7, 12)
    _, num_tokens = grpo.batch_counts(mask)
    x = logp.clone().requires_grad_(True)
    total = 0.0
    for rows in (slice(0, 2), slice(2, 7)):
        loss, _ = dapo.policy_loss(x[rows], old[rows], adv[rows], mask[rows], num_tokens=num_tokens)
        loss.backward()
        total += loss.item()
    want_loss, want_grad = ref_dapo_loss(logp.tolist(), old.tolist(), adv.tolist(), mask.tolist())
    assert abs(total - want_loss) <= TOL
    torch.testing.assert_close(x.grad, torch.tensor(want_grad, dtype=F64), rtol=0, atol=TOL)


def test_clip_higher_lets_a_rising_token_keep_its_gradient():
    # A = +1, ratio 1.25: inside DAPO's [0.8, 1.28] but past GRPO's symmetric 1.2.
    old = torch.tensor([[-2.0, -1.0]], dtype=F64)
    logp = old + torch.tensor([[math.log(1.25), math.log(0.75)]], dtype=F64)
    adv, mask = torch.tensor([1.0], dtype=F64), torch.ones(1, 2)
    x = logp.clone().requires_grad_(True)
    loss, m = dapo.policy_loss(x, old, adv, mask)
    loss.backward()
    # token 0: -1.25 (unclipped); token 1: ratio 0.75 < 0.8 with A > 0 is not clipped either: -0.75.
    assert loss.item() == pytest.approx((-1.25 - 0.75) / 2, abs=1e-14)
    torch.testing.assert_close(x.grad, torch.tensor([[-1.25 / 2, -0.75 / 2]], dtype=F64))
    assert m["clip_frac_high"] == 0.0
    y = logp.clone().requires_grad_(True)
    sym_loss, sym_m = grpo.policy_loss(y, old, adv, mask, agg="token-mean")
    sym_loss.backward()
    assert sym_loss.item() == pytest.approx((-1.2 - 0.75) / 2, abs=1e-14)
    assert y.grad[0, 0] == 0 and sym_m["clip_frac_high"] == 0.5


# ---------------------------------------------------------------- dynamic sampling

def test_informative_groups_hand_and_random():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [-0.5, -0.5, -0.25]])
    assert dapo.informative_groups(rewards).tolist() == [False, True, False, True]
    assert dapo.informative_groups(torch.tensor([[3.0], [1.0]])).tolist() == [False, False]
    gen = torch.Generator().manual_seed(11)
    r = torch.randint(0, 2, (40, 5), generator=gen).to(F64)
    want = [len(set(row)) > 1 for row in r.tolist()]
    assert dapo.informative_groups(r).tolist() == want and 0 < sum(want) < 40


# ---------------------------------------------------------------- overlong shaping

def test_overlong_penalty_hand_computed():
    # max_len 20, cache 4: free up to 16, then -1/4 per extra token, -1 at 20 and beyond.
    got = dapo.overlong_penalty(torch.tensor([0, 16, 17, 18, 19, 20, 21, 100]), 20, 4)
    assert got.dtype == torch.get_default_dtype()
    assert got.tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0, -1.0]
    assert dapo.overlong_penalty([5, 10, 11], 10, 0).tolist() == [0.0, 0.0, -1.0]
    assert dapo.overlong_penalty([3, 4], 4, 4, dtype=F64).tolist() == [-0.75, -1.0]
    for bad in ((10, 11), (10, -1)):
        with pytest.raises(ValueError):
            dapo.overlong_penalty([1], *bad)


@pytest.mark.parametrize("max_len,cache_len", [(512, 128), (37, 11), (20480, 4096)])
def test_overlong_penalty_matches_reference(max_len, cache_len):
    gen = torch.Generator().manual_seed(seed_of(max_len, cache_len))
    lengths = torch.randint(0, max_len + cache_len, (257,), generator=gen)
    got = dapo.overlong_penalty(lengths, max_len, cache_len, dtype=F64)
    want = torch.tensor([ref_overlong(n, max_len, cache_len) for n in lengths.tolist()], dtype=F64)
    torch.testing.assert_close(got, want, rtol=0, atol=TOL)
    assert ((got < 0) & (got > -1)).any() and (got == 0).any() and (got == -1).any()


def test_overlong_filter_masks_exactly_the_truncated_samples():
    gen = torch.Generator().manual_seed(9)
    logp, old, adv, mask = random_batch(gen, 6, 8)
    truncated = torch.tensor([False, True, False, False, True, False])
    assert dapo.overlong_filter_mask(truncated).tolist() == [True, False, True, True, False, True]
    filtered = dapo.apply_overlong_filter(mask, truncated)
    assert filtered.dtype == torch.bool and not filtered[truncated].any()
    assert torch.equal(filtered[~truncated], mask[~truncated])
    float_mask = dapo.apply_overlong_filter(mask.to(F64), truncated.tolist())
    assert float_mask.dtype == F64 and torch.equal(float_mask.bool(), filtered)
    # The filtered loss is the loss over the kept samples alone, and truncated samples get no gradient.
    x = logp.clone().requires_grad_(True)
    loss, _ = dapo.policy_loss(x, old, adv, filtered)
    loss.backward()
    keep = ~truncated
    alone, _ = dapo.policy_loss(logp[keep], old[keep], adv[keep], mask[keep])
    assert abs(loss.item() - alone.item()) <= TOL
    assert torch.equal(x.grad[truncated], torch.zeros_like(x.grad[truncated]))
