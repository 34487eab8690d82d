"""Countdown: reach a target from four numbers with + - * /, each number used once.

The task of the AQN replication (results/aqn_replication): one where a policy has to search. The
arithmetic task (arith.py) tells the policy what to compute, so sampling at temperature 1 only adds
slips to a known path; here the policy is told only the numbers and the target, and must find which
numbers to combine, in which order, with which operation. A policy that is right 10% of the time
still has most problems to discover, which is what exploration (temperature, quantization noise) is
supposed to help with.

    Numbers: 25 4 7 3. Target: 96.

    25*4=100
    100-7=93
    93+3=96
    #### ((25*4)-7)+3

Generation, solvable by construction. A problem is drawn as a game is played: four numbers from
NUMBER_RANGE; three times, two numbers of the pool are taken out and combined with an operation
whose result is a positive integer of at most MAX_VALUE (a - b only when a > b, a / b only when b
divides a), and the result goes back into the pool; the last result is the target, kept when it lies
in TARGET_RANGE (else the draw starts again). Every problem therefore has at least the solution it
was drawn with. Each step is written `a<op>b=c` with the larger operand first for + and *, so the
order inside a step carries no information; the expression after `####` nests every step that is not
a bare number in parentheses (no precedence to get right, only copying).

Records. `load(split, n, seed)` returns
    {"question": "Numbers: 25 4 7 3. Target: 96.", "kind": "countdown",
     "answer": "25 4 7 3 -> 96 : ((25*4)-7)+3",   (the gold: numbers, target, one reference solution)
     "solution": "25*4=100\\n100-7=93\\n93+3=96\\n#### ((25*4)-7)+3"}   (what the policy is taught)
The gold holds no `####`, so a reader that splits GSM8K golds at `####` leaves it whole; grade needs
only its numbers and target (`parse_gold`), the reference expression is there for people.

Splits. A problem's content is its numbers as a multiset and its target; its SHA-256 (not Python's
salted `hash`) decides the split: 0 mod TEST_FRACTION is "test", anything else "train". The partition
does not depend on the seed, the order the numbers are shown in, or the solution drawn, so a held-out
problem is never trained on. `load` seeds `random.Random` with (seed, split), keeps the draws of its
split, drops repeats, and returns the first n: a smaller n is a prefix of a larger one.

Grading (strict, the only mode). The answer is read from the completion's LAST `####`: the rest of
that line, `EXPR` or `EXPR = N`. It is right when
    - EXPR is made of non-negative integers written without leading zeros, the binary operators
      + - * / (or their Unicode forms − × ÷ ∗ ⋅ ∕) and parentheses, with any whitespace; no unary
      sign, no implicit product, no other character (a trailing period included);
    - its numbers are the problem's four, each exactly once (as a multiset);
    - its value, computed exactly with Fractions (so 7/2 is 7/2, never 3, and an intermediate
      fraction that lands on the target counts), equals the target, with no division by zero;
    - and N, when the line claims one, equals the target too.
An answer anywhere else (no `####` line, an `<answer>` tag, the expression on an earlier line) is not
read. `verdict` says which rule failed; `grade` is `verdict == "right"`.
"""

import argparse
import hashlib
import json
import random
import re
from fractions import Fraction
from pathlib import Path

SPLITS = ("train", "test")
DEFAULT_SIZE = {"train": 100_000, "test": 1000}
TEST_FRACTION = 10  # one problem in TEST_FRACTION is held out
N_NUMBERS = 4
NUMBER_RANGE = (1, 25)
MAX_VALUE = 1000  # the largest intermediate value a drawn solution may reach
TARGET_RANGE = (1, 200)
OPS = "+-*/"
INSTRUCTION = ('Use each number exactly once with + - * / to reach the target. Combine two numbers a step, '
               'then write the expression after "####".')
KIND = "countdown"
# The hard problems: those the replication's policy (assets/countdown) solved in none of its samples before RL,
# picked from both splits by experiments/hard_problems.py and kept here as {split}.jsonl (load_hard)
HARD_DIR = Path(__file__).resolve().parent / "assets" / "countdown_hard"

# The Unicode operators read as their ASCII forms: minus sign, multiplication sign, division sign,
# asterisk operator, dot operator, division slash.
_UNICODE_OPS = str.maketrans({"\u2212": "-", "\u00d7": "*", "\u00f7": "/", "\u2217": "*", "\u22c5": "*",
                              "\u2215": "/"})
_GOLD = re.compile(r"^\s*(\d+(?:\s+\d+)*)\s*->\s*(\d+)\s*(?::\s*(.*?))?\s*$", re.DOTALL)


# ---------------------------------------------------------------------------------------------
# Drawing problems
# ---------------------------------------------------------------------------------------------

def apply(op, a, b):
    """a op b, exactly (a Fraction for a division)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    return Fraction(a) / Fraction(b)


def split_of(numbers, target):
    """The split of a problem: a pure function of its numbers (as a multiset) and target."""
    key = " ".join(map(str, sorted(numbers))) + f"->{target}"
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h % TEST_FRACTION == 0 else "train"


def _step_options(a, b):
    """The (x, op, y, result) steps that combine a and b under the drawing rules: a positive integer
    result of at most MAX_VALUE, the larger operand first."""
    x, y = max(a, b), min(a, b)
    out = [(x, "+", y, x + y)]
    if x > y:
        out.append((x, "-", y, x - y))
    if x * y <= MAX_VALUE:
        out.append((x, "*", y, x * y))
    if x % y == 0:
        out.append((x, "/", y, x // y))
    return [s for s in out if s[3] <= MAX_VALUE]


def _draw(rng):
    """(numbers as shown, target, steps [(x, op, y, z)], expression): one game played at random."""
    while True:
        numbers = [rng.randint(*NUMBER_RANGE) for _ in range(N_NUMBERS)]
        pool = [(n, str(n)) for n in numbers]  # (value, its expression)
        steps = []
        while len(pool) > 1:
            i, j = rng.sample(range(len(pool)), 2)
            (a, ea), (b, eb) = pool[i], pool[j]
            x, op, y, z = rng.choice(_step_options(a, b))
            ex, ey = (ea, eb) if a >= b else (eb, ea)
            wrap = lambda e: e if e.isdigit() else f"({e})"  # noqa: E731
            pool = [p for k, p in enumerate(pool) if k not in (i, j)] + [(z, f"{wrap(ex)}{op}{wrap(ey)}")]
            steps.append((x, op, y, z))
        target, expression = pool[0]
        if TARGET_RANGE[0] <= target <= TARGET_RANGE[1]:
            return numbers, target, steps, expression


def trace(steps, expression):
    """The solution text the policy is taught: one step a line, then `#### expression`."""
    return "\n".join(f"{x}{op}{y}={z}" for x, op, y, z in steps) + f"\n#### {expression}"


def question(numbers, target):
    return f"Numbers: {' '.join(map(str, numbers))}. Target: {target}."


def gold(numbers, target, expression=None):
    """The gold answer string: `N1 N2 N3 N4 -> T`, and ` : expression` when a solution is given."""
    return f"{' '.join(map(str, numbers))} -> {target}" + (f" : {expression}" if expression else "")


def parse_gold(text):
    """(numbers, target, reference expression or None) of a gold string; ValueError when malformed."""
    m = _GOLD.match(str(text))
    if not m:
        raise ValueError(f"countdown gold must read 'N1 N2 N3 N4 -> TARGET [: EXPR]', got {text!r}")
    return tuple(int(v) for v in m.group(1).split()), int(m.group(2)), m.group(3) or None


def load(split, n=None, seed=0):
    """`n` problems (default DEFAULT_SIZE[split]) of `split`, deterministic in (split, seed), as records
    {"question", "answer" (the gold), "kind": "countdown", "solution" (the taught trace)}."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n is not None and not (isinstance(n, int) and n >= 0):
        raise ValueError(f"n must be a whole number >= 0 (how many problems) or None for DEFAULT_SIZE[split], got {n!r}")
    n = DEFAULT_SIZE[split] if n is None else n
    rng = random.Random(f"countdown-{seed}-{split}")
    seen, items = set(), []
    while len(items) < n:
        numbers, target, steps, expression = _draw(rng)
        key = (tuple(sorted(numbers)), target)
        if key in seen or split_of(numbers, target) != split:
            continue
        seen.add(key)
        items.append({"question": question(numbers, target), "answer": gold(numbers, target, expression),
                      "kind": KIND, "solution": trace(steps, expression)})
    return items


def load_hard(split, n=None, seed=0, folder=None):
    """The first `n` (default: all) of the hard problems of `split` (HARD_DIR/{split}.jsonl, records as load's).
    They are fixed by the policy they were picked for, not drawn, so `seed` is accepted (load's callers pass
    one) and must be 0."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if seed != 0:
        raise ValueError(f"the hard problems are a fixed list, not a draw: seed must be 0, got {seed!r}")
    folder = HARD_DIR if folder is None else folder
    path = Path(folder) / f"{split}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: pick the hard problems first, with "
                                f"`python experiments/hard_problems.py --out {folder}` (a GPU: minutes)")
    with open(path, encoding="utf-8") as f:
        items = [json.loads(line) for line in f if line.strip()]
    if n is not None and n > len(items):
        raise ValueError(f"{path} holds {len(items)} problems, not {n}: ask for {len(items)} or fewer")
    return items[:n]


# ---------------------------------------------------------------------------------------------
# Reading and judging an answer
# ---------------------------------------------------------------------------------------------

class InvalidAnswer(ValueError):
    """An answer that is not a well-formed expression (its message says why)."""


def _tokens(text):
    """Numbers (int) and the characters + - * / ( ) of an expression; InvalidAnswer for anything else."""
    out, i, text = [], 0, text.translate(_UNICODE_OPS)
    while i < len(text):
        c = text[i]
        if c.isspace():
            i += 1
        elif c in "0123456789":  # (ASCII digits only: str.isdigit accepts ² and Arabic-Indic digits)
            j = i
            while j < len(text) and text[j] in "0123456789":
                j += 1
            if text[i] == "0" and j - i > 1:
                raise InvalidAnswer(f"leading zero in {text[i:j]!r}")
            out.append(int(text[i:j]))
            i = j
        elif c in OPS + "()":
            out.append(c)
            i += 1
        else:
            raise InvalidAnswer(f"unexpected character {c!r}")
    return out


def _parse(tokens):
    """(value, numbers used) of a token list, by recursive descent over
        expr := term (('+' | '-') term)*     term := factor (('*' | '/') factor)*     factor := N | '(' expr ')'
    The value is None where the expression divides by zero; a malformed one raises InvalidAnswer."""
    pos = 0

    def peek():
        return tokens[pos] if pos < len(tokens) else None

    def factor():
        nonlocal pos
        t = peek()
        if isinstance(t, int):
            pos += 1
            return Fraction(t), [t]
        if t == "(":
            pos += 1
            v, used = expr()
            if peek() != ")":
                raise InvalidAnswer("unclosed parenthesis")
            pos += 1
            return v, used
        raise InvalidAnswer(f"expected a number or '(' at token {pos}, got {t!r}")

    def chain(operand, ops):
        nonlocal pos
        v, used = operand()
        while peek() in ops:
            op = tokens[pos]
            pos += 1
            w, more = operand()
            undefined = v is None or w is None or (op == "/" and w == 0)
            v, used = None if undefined else apply(op, v, w), used + more
        return v, used

    def term():
        return chain(factor, ("*", "/"))

    def expr():
        return chain(term, ("+", "-"))

    value, used = expr()
    if pos != len(tokens):
        raise InvalidAnswer(f"unexpected {tokens[pos]!r} after a complete expression")
    return value, used


def extract(completion):
    """The answer text: the rest of the line after the completion's last `####`, stripped, or None."""
    if "####" not in completion:
        return None
    line = completion.rsplit("####", 1)[1].split("\n", 1)[0].strip()
    return line or None


def read_answer(completion):
    """(value or None after a division by zero, numbers used, claimed result or None) of the answer
    line; None when there is no answer, InvalidAnswer (a ValueError) when it is not an expression."""
    answer = extract(completion)
    if answer is None:
        return None
    expr, *claim = answer.split("=")
    if len(claim) > 1:
        raise InvalidAnswer("more than one '='")
    claimed = None
    if claim:
        c = _tokens(claim[0])
        if len(c) != 1 or not isinstance(c[0], int):
            raise InvalidAnswer(f"'= {claim[0].strip()}' is not one number")
        claimed = c[0]
    value, used = _parse(_tokens(expr))
    return value, used, claimed


def verdict(completion, gold_text):
    """Why the completion is right or not, one of: "right", "missing" (no answer after a `####`),
    "syntax" (not an expression of numbers, + - * / and parentheses, or more than one `=`), "numbers"
    (not the problem's numbers each once), "division by zero", "value" (another value than the target),
    "claim" (right expression, but `= N` claims another number)."""
    numbers, target, _ = parse_gold(gold_text)
    try:
        answer = read_answer(completion)
    except InvalidAnswer:
        return "syntax"
    if answer is None:
        return "missing"
    value, used, claimed = answer
    if sorted(used) != sorted(numbers):
        return "numbers"
    if value is None:
        return "division by zero"
    if value != target:
        return "value"
    if claimed is not None and claimed != target:
        return "claim"
    return "right"


def grade(completion, gold_text):
    """True when the completion's `####` line is a valid expression of the problem's numbers, each
    once, equal to its target (the module docstring has every rule)."""
    return verdict(completion, gold_text) == "right"


def has_answer(completion):
    """Whether the completion gives an answer in the asked form: a `####` line holding a well-formed
    expression (right or wrong, whatever its numbers), for a format reward."""
    try:
        return read_answer(completion) is not None
    except InvalidAnswer:
        return False


def main(argv=None):
    p = argparse.ArgumentParser(description="Print Countdown problems with their taught solutions.")
    p.add_argument("--split", default="train", choices=SPLITS, help="which split to draw from")
    p.add_argument("-n", "--num", type=int, default=5, help="how many problems")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw")
    args = p.parse_args(argv)
    if args.num < 1:
        p.error(f"--num {args.num}: must be >= 1")
    for item in load(args.split, args.num, seed=args.seed):
        print(f"{item['question']}\n{item['solution']}\n  (gold: {item['answer']})\n")


if __name__ == "__main__":
    main()
