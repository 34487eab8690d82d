"""arith.py: determinism, disjoint splits, and gold solutions that are right and match their story."""

import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import arith  # noqa: E402

# An independent reading of the story: which operation each verb phrase means. Written from the
# wording, not imported from arith, so a template wired to the wrong operator is caught.
VERB_OPS = [("more", "+"), ("times as many", "*"), ("gives away", "-"), ("loses", "-"), ("sells", "-"),
            ("to a friend", "-")]


def story_chain(question):
    """(start, [(op, y)]) read off the question text alone."""
    sentences = [s.strip() for s in question.split(".") if s.strip()]
    start = int(re.search(r"\d+", sentences[0]).group())
    ops = []
    for sentence in sentences[1:]:
        if sentence.startswith("How many"):
            break
        for phrase in sentence.split(" and "):
            op = next(o for key, o in VERB_OPS if key in phrase)
            ops.append((op, int(re.search(r"\d+", phrase).group())))
    return start, ops


def evaluate_chain(start, ops):
    x = start
    for op, y in ops:
        x = eval(f"{x}{op}{y}")  # Python's own arithmetic as the reference
    return x


def test_deterministic_and_prefix_stable():
    seed = random.randrange(1000)
    a = arith.load("train", 300, seed=seed)
    assert a == arith.load("train", 300, seed=seed)
    assert a[:120] == arith.load("train", 120, seed=seed)
    assert a != arith.load("train", 300, seed=seed + 1)
    assert len(arith.load("test")) == arith.DEFAULT_SIZE["test"]


@pytest.mark.parametrize("split", arith.SPLITS)
def test_gold_solutions_correct(split):
    items = arith.load(split, 400, seed=random.randrange(1000))
    for item in items:
        q, ans = item["question"], item["answer"]
        assert re.search(r"\n#### \d+$", ans), ans
        steps, final = arith.parse_solution(ans)
        # The solution text is exactly its equations plus the final line: nothing unparsed.
        assert ans == " ".join(f"{x}{op}{y}={z}." for x, op, y, z in steps) + f"\n#### {final}"
        assert 2 <= len(steps) <= 4
        for x, op, y, z in steps:
            assert eval(f"{x}{op}{y}") == z, ans
        for prev, cur in zip(steps, steps[1:]):
            assert cur[0] == prev[3], ans  # each step starts from the previous result
        assert steps[-1][3] == final
        start, ops = story_chain(q)
        assert start == steps[0][0]
        assert ops == [(op, y) for _, op, y, _ in steps], (q, ans)
        assert evaluate_chain(start, ops) == final
        assert final >= 1


def test_splits_disjoint():
    # Across different seeds too: the partition depends only on the arithmetic.
    train = arith.load("train", 5000, seed=0) + arith.load("train", 2000, seed=7)
    test = arith.load("test", 500, seed=0) + arith.load("test", 500, seed=3)
    chains = lambda items: {story_chain(it["question"]).__repr__() for it in items}  # noqa: E731
    train_chains, test_chains = chains(train), chains(test)
    assert len(test_chains) > 900  # seeds 0 and 3 share few chains: the set is not degenerate
    assert not train_chains & test_chains
    assert not {it["question"] for it in train} & {it["question"] for it in test}
    # Roughly one chain in TEST_FRACTION is held out, so the hash rule does not starve either split.
    rng = random.Random(1)
    held = sum(arith.split_of(*arith._draw_chain(rng)) == "test" for _ in range(5000))
    assert 0.06 < held / 5000 < 0.14
    # No duplicate chains within a split either.
    assert len(chains(arith.load("test", 500))) == 500


def test_bad_split():
    with pytest.raises(ValueError):
        arith.load("validation")


def test_negative_count_is_refused():
    with pytest.raises(ValueError, match="n must be >= 0"):
        arith.load("test", n=-1)
    assert arith.load("test", n=0) == []


def test_chains_are_counted_exactly(monkeypatch):
    """On narrowed ranges (small enough to list): chains() lists each chain the rules allow once, as an
    enumeration written here from the module docstring's rules finds them; count_chains' dynamic programme
    counts them without listing; every drawn chain is among them; the splits partition them. On the real
    ranges the counts add up to CHAINS, and MAX_SIZE is a tenth of each split."""
    assert arith.count_chains() == sum(arith.CHAINS.values()) == 12503287
    assert arith.MAX_SIZE == {s: arith.CHAINS[s] // 10 for s in arith.SPLITS}
    for name, value in (("START_RANGE", (2, 5)), ("ADD_RANGE", (2, 3)), ("SUB_RANGE", (1, 3)), ("MUL_RANGE", (2, 3)),
                        ("MUL_CAP", 9)):
        monkeypatch.setattr(arith, name, value)

    def allowed(x):  # (op, y) after the running value x: + always, - down to 1, * while the product stays <= the cap
        return ([("+", y) for y in (2, 3)] + [("-", y) for y in (1, 2, 3) if x - y >= 1]
                + [("*", y) for y in (2, 3) if 2 * x <= 9 and x * y <= 9])

    want = set()

    def walk(start, x, ops):
        if 2 <= len(ops):
            want.add((start, tuple(ops)))
        for op, y in allowed(x) if len(ops) < 4 else ():
            walk(start, eval(f"{x}{op}{y}"), ops + [(op, y)])

    for start in range(2, 6):
        walk(start, start, [])
    listed = [(s, tuple(ops)) for s, ops in arith.chains()]
    assert len(listed) == len(set(listed)) and set(listed) == want
    assert arith.count_chains() == len(want)
    assert arith.count_chains("test") + arith.count_chains("train") == len(want) and arith.count_chains("test") > 0
    rng = random.Random(random.randrange(1000))
    drawn = {(s, tuple(ops)) for s, ops in (arith._draw_chain(rng) for _ in range(3000))}
    assert drawn <= want  # (the draw never makes a chain the count leaves out)


def test_more_problems_than_a_split_gives_are_refused_at_once(monkeypatch):
    """Asked for more distinct problems than MAX_SIZE, load refuses before drawing any (it used to draw
    forever once a split ran out of new chains)."""
    def no_draw(rng):
        raise AssertionError("drew a chain")

    monkeypatch.setattr(arith, "_draw_chain", no_draw)
    for split in arith.SPLITS:
        with pytest.raises(ValueError, match=f"arith's {split} split gives at most {arith.MAX_SIZE[split]} distinct "
                                             f"problems .*; ask for {arith.MAX_SIZE[split]} or fewer"):
            arith.load(split, arith.MAX_SIZE[split] + 1)
    with pytest.raises(ValueError, match="at most 125125"):
        arith.load("test", 10**9)
