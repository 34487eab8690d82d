"""countdown.py: problems drawn deterministically, disjoint splits, solvable by construction, and a strict
grader checked against Python's own arithmetic on Fractions."""

import itertools
import random
import re
import sys
from fractions import Fraction
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import countdown  # noqa: E402


def reference_value(expr):
    """Python's evaluation of an ASCII expression with every number made a Fraction: an independent
    judge of what countdown._parse computes (None when Python cannot read it or divides by zero)."""
    if not re.fullmatch(r"[\d+\-*/() ]+", expr):
        return None
    try:
        return eval(re.sub(r"\d+", lambda m: f"Fraction({int(m.group())})", expr), {"Fraction": Fraction})
    except (SyntaxError, ZeroDivisionError):
        return None


def reachable(numbers, target):
    """Whether some expression of all the numbers, each once, equals target (exhaustive over every pair
    combined with every operation, with Fractions): an independent solver."""
    if len(numbers) == 1:
        return numbers[0] == target
    for i, j in itertools.permutations(range(len(numbers)), 2):
        rest = [n for k, n in enumerate(numbers) if k not in (i, j)]
        a, b = numbers[i], numbers[j]
        for v in (a + b, a - b, a * b) + ((a / b,) if b else ()):
            if reachable(rest + [v], target):
                return True
    return False


# --- drawing problems -----------------------------------------------------------------------------

def test_deterministic_and_prefix_stable():
    seed = random.randrange(1000)
    a = countdown.load("train", 300, seed=seed)
    assert a == countdown.load("train", 300, seed=seed)
    assert a[:120] == countdown.load("train", 120, seed=seed)
    assert a != countdown.load("train", 300, seed=seed + 1)
    assert len(countdown.load("test")) == countdown.DEFAULT_SIZE["test"]
    assert countdown.load("test", 0) == []


def content(item):
    numbers, target, _ = countdown.parse_gold(item["answer"])
    return tuple(sorted(numbers)), target


def test_splits_share_no_problem_whatever_the_seeds():
    train = countdown.load("train", 4000, seed=random.randrange(1000))
    test = countdown.load("test", 600, seed=random.randrange(1000))
    tr, te = {content(it) for it in train}, {content(it) for it in test}
    assert len(tr) == len(train) and len(te) == len(test)  # no repeats within a split
    assert not tr & te
    for it in train[:200] + test[:200]:
        assert countdown.split_of(*content(it)) == ("train" if it in train else "test")
        numbers, target, _ = countdown.parse_gold(it["answer"])
        shuffled = random.sample(numbers, len(numbers))  # the order the numbers are shown in is not content
        assert countdown.split_of(shuffled, target) == countdown.split_of(numbers, target)
    # The held-out fraction of all problems is 1 / TEST_FRACTION: over 2000 draws the share of test
    # problems lies within 4 binomial standard deviations of it.
    rng = random.Random(7)
    draws = [countdown._draw(rng) for _ in range(2000)]
    share = sum(countdown.split_of(n, t) == "test" for n, t, _, _ in draws) / len(draws)
    p = 1 / countdown.TEST_FRACTION
    assert abs(share - p) < 4 * (p * (1 - p) / len(draws)) ** 0.5


@pytest.mark.parametrize("split", countdown.SPLITS)
def test_records_are_solvable_and_their_solutions_right(split):
    items = countdown.load(split, 300, seed=random.randrange(1000))
    for it in items:
        assert it["kind"] == "countdown" and "####" not in it["answer"]
        numbers, target, expression = countdown.parse_gold(it["answer"])
        assert it["question"] == f"Numbers: {' '.join(map(str, numbers))}. Target: {target}."
        assert len(numbers) == 4 and all(countdown.NUMBER_RANGE[0] <= n <= countdown.NUMBER_RANGE[1] for n in numbers)
        assert countdown.TARGET_RANGE[0] <= target <= countdown.TARGET_RANGE[1]
        # The taught trace: three steps, each combining two numbers of the pool as a game does, then the
        # expression of those steps; Python agrees with every step and with the expression.
        *steps, last = it["solution"].split("\n")
        assert len(steps) == 3 and last == f"#### {expression}"
        pool = list(numbers)
        for line in steps:
            x, op, y, z = re.fullmatch(r"(\d+)([-+*/])(\d+)=(\d+)", line).groups()
            x, y, z = int(x), int(y), int(z)
            assert reference_value(f"{x}{op}{y}") == z and 0 < z <= countdown.MAX_VALUE, line
            assert x >= y  # (the larger operand first)
            pool.remove(x)
            pool.remove(y)
            pool.append(z)
        assert pool == [target]
        assert reference_value(expression) == target
        assert sorted(int(v) for v in re.findall(r"\d+", expression)) == sorted(numbers)
        assert countdown.grade(it["solution"], it["answer"])
    for it in items[:40]:  # (the exhaustive solver is slow in Python: a sample)
        numbers, target, _ = countdown.parse_gold(it["answer"])
        assert reachable([Fraction(n) for n in numbers], target)


def test_bad_load_arguments():
    with pytest.raises(ValueError, match="split must be one of"):
        countdown.load("validation", 3)
    for n in (-1, 2.5):
        with pytest.raises(ValueError, match="n must be a whole number >= 0"):
            countdown.load("train", n)


# --- grading --------------------------------------------------------------------------------------

GOLD = "25 4 7 3 -> 96 : ((25*4)-7)+3"
CASES = [  # (completion, verdict) for GOLD
    ("25*4=100\n100-7=93\n93+3=96\n#### ((25*4)-7)+3", "right"),
    ("#### 25*4-7+3", "right"),  # precedence, no parentheses
    ("####25*4-7+3", "right"),
    ("#### 3 + 25 * 4 - 7\n", "right"),
    ("#### \t( 25 * 4 ) - 7 + 3  ", "right"),
    ("#### 25\u00a0*\u00a04-7+3", "right"),  # no-break spaces are whitespace
    ("#### 25\u00d74\u22127+3", "right"),  # multiplication sign, minus sign
    ("#### 25 \u22c5 4 \u2212 7 + 3", "right"),  # dot operator
    ("#### 25\u22174-7+3", "right"),  # asterisk operator
    ("#### (25*4-7)+3 = 96", "right"),
    ("#### 1+2\n#### 25*4-7+3", "right"),  # the last #### line counts
    ("#### 25*4-7+3\nthat is all", "right"),  # text on later lines is not the answer
    # the answer is not where it must be
    ("25*4-7+3", "missing"),
    ("<answer>25*4-7+3</answer>", "missing"),
    ("####\n25*4-7+3", "missing"),  # the expression on the line after the marker
    ("#### ", "missing"),
    ("", "missing"),
    ("#### 25*4-7+3\n#### 100-4", "numbers"),  # only the last one is read
    # not an expression
    ("#### 25*4-7+3.", "syntax"),
    ("#### -7+25*4+3", "syntax"),  # unary minus (the value would be 96)
    ("#### +25*4-7+3", "syntax"),
    ("#### 25(4)-7+3", "syntax"),  # implicit product
    ("#### 25*4-7+3 3", "syntax"),
    ("#### 25**4-7+3", "syntax"),
    ("#### 25^4-7+3", "syntax"),
    ("#### ((25*4)-7+3", "syntax"),
    ("#### (25*4)-7+3)", "syntax"),
    ("#### 25*04-7+3", "syntax"),  # leading zero
    ("#### 25.0*4-7+3", "syntax"),
    ("#### 25x4-7+3", "syntax"),
    ("#### 25*4-7+\u00b3", "syntax"),  # a superscript digit is no digit here
    ("#### ()25*4-7+3", "syntax"),
    ("#### 25*4-7+3 = 96 = 96", "syntax"),
    ("#### 25*4-7+3 = ninety-six", "syntax"),
    ("#### 25*4-7+3 =", "syntax"),
    ("#### 25*4-7+3*", "syntax"),
    # wrong numbers
    ("#### 25*4-4", "numbers"),  # 7 and 3 missing, 4 reused
    ("#### 25*4-7+3+3-3", "numbers"),  # 3 reused
    ("#### 25*4-7+3*1", "numbers"),  # 1 is not given
    ("#### 100-7+3", "numbers"),  # an intermediate result as a number
    ("#### 96", "numbers"),
    # right numbers, wrong value or claim
    ("#### 25*4-7-3", "value"),
    ("#### 25*4-7-3 = 96", "value"),  # the claim does not make the value right
    ("#### ((25*4)-7)+3 = 95", "claim"),
    ("#### 25*4-7+3 = 0096", "syntax"),
]


@pytest.mark.parametrize("completion,expected", CASES)
def test_verdicts(completion, expected):
    assert countdown.verdict(completion, GOLD) == expected
    assert countdown.grade(completion, GOLD) == (expected == "right")


@pytest.mark.parametrize("completion,gold,expected", [
    ("#### 5/(3-3)+2", "5 3 3 2 -> 7", "division by zero"),
    ("#### (7/2)*1*1", "7 2 1 1 -> 3", "value"),  # 3.5: division is exact, never truncated to 3
    ("#### (7/2)*4*1", "7 2 4 1 -> 14", "right"),  # a fraction on the way is fine
    ("#### 7/2*4*1", "7 2 4 1 -> 14", "right"),
    ("#### 7\u00f72*4*1", "7 2 4 1 -> 14", "right"),  # division sign
    ("#### 7\u22152*4*1", "7 2 4 1 -> 14", "right"),  # division slash
    ("#### 1/3+1/3+1/3*3", "1 3 1 3 -> 1", "numbers"),
    ("#### (1+1)/(3-3)", "1 3 1 3 -> 1", "division by zero"),
    ("#### 6/4*(3-1)", "6 4 3 1 -> 3", "right"),
    ("#### 0+5-5+9", "0 5 5 9 -> 9", "right"),  # (a lone 0 is no leading zero)
    ("#### 9+5+5", "9 5 5 -> 19", "right"),  # the gold decides how many numbers
])
def test_exact_division(completion, gold, expected):
    assert countdown.verdict(completion, gold) == expected


def test_grader_agrees_with_python_on_random_expressions():
    """Random expressions over a problem's numbers (random trees, all four operations, some with a
    number dropped or swapped): right exactly when Python's Fraction arithmetic says the value is the
    target and the numbers are the problem's."""
    rng = random.Random(random.randrange(10**6))
    items = countdown.load("test", 50, seed=rng.randrange(100))
    seen = set()
    for _ in range(3000):
        numbers, target, _ = countdown.parse_gold(rng.choice(items)["answer"])
        leaves = [str(n) for n in numbers]
        if rng.random() < 0.2:
            leaves[rng.randrange(4)] = str(rng.randint(1, 30))
        rng.shuffle(leaves)
        while len(leaves) > 1:
            i = rng.randrange(len(leaves) - 1)
            leaves[i:i + 2] = [f"({leaves[i]}{rng.choice('+-*/')}{leaves[i + 1]})"]
        expr = leaves[0][1:-1]
        want = reference_value(expr)
        uses = sorted(int(v) for v in re.findall(r"\d+", expr)) == sorted(numbers)
        expected = "right" if uses and want == target else (
            "numbers" if not uses else "division by zero" if want is None else "value")
        got = countdown.verdict(f"#### {expr}", countdown.gold(numbers, target))
        assert got == expected, (expr, numbers, target)
        seen.add(got)
    assert seen >= {"right", "numbers", "value", "division by zero"}  # (every branch was exercised)


def test_extract_and_has_answer():
    assert countdown.extract("a\n#### 1+2 \nb") == "1+2"
    assert countdown.extract("no marker") is None and countdown.extract("####   \n1+2") is None
    assert countdown.has_answer("#### (1+2)*3")
    assert countdown.has_answer("#### 1+2 = 4")  # well-formed though wrong: the format is right
    assert countdown.has_answer("#### 5/(3-3)")  # (well-formed; its value is another matter)
    for bad in ("#### 1+", "#### 1 = 2 = 3", "1+2", "#### x", "<answer>1+2</answer>"):
        assert not countdown.has_answer(bad), bad


def test_gold_strings():
    assert countdown.parse_gold(GOLD) == ((25, 4, 7, 3), 96, "((25*4)-7)+3")
    assert countdown.parse_gold("25 4 7 3 -> 96") == ((25, 4, 7, 3), 96, None)
    assert countdown.gold((1, 2, 3, 4), 10, "1+2+3+4") == "1 2 3 4 -> 10 : 1+2+3+4"
    assert countdown.verdict("#### 1+2+3+4", "1 2 3 4 -> 10") == "right"  # no reference needed
    for bad in ("#### 96", "96", "25 4 7 3 => 96", "a b -> 3", ""):
        with pytest.raises(ValueError, match="countdown gold must read"):
            countdown.parse_gold(bad)


def test_cli_prints_problems(capsys):
    countdown.main(["--split", "test", "-n", "2", "--seed", "3"])
    out = capsys.readouterr().out
    items = countdown.load("test", 2, seed=3)
    for it in items:
        assert it["question"] in out and it["solution"] in out
    with pytest.raises(SystemExit):
        countdown.main(["-n", "0"])
