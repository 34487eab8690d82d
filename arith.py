"""Synthetic multi-step arithmetic word problems in GSM8K's answer format.

The bundled tiny policy (tiny.py, assets/tiny/) is trained on this task and RL then improves it, so the
task has to be (1) cheap to generate in any quantity, (2) deterministic from a seed, (3) graded by the
same `#### N` rule as GSM8K, and (4) split into a train part and a held-out part that share no problem.

A problem is a chain of 2-4 operations on a running count, told as a short story:

    Tom has 12 apples. He buys 7 more and gives away 5. How many apples does Tom have now?

    12+7=19. 19-5=14.
    #### 14

- The story starts from a count `a` in [2, 20]; each operation is `+ b` (b in [2, 15]), `- b`
  (b in [1, 15], never going below 1) or `* k` (k in [2, 4], only while the product stays <= 200), in
  random order. Each operation is a verb phrase ("buys 7 more", "gives away 5", "then has 3 times as
  many"); one or two phrases make a sentence ("He buys 7 more and gives away 5.").
- The solution is one equation per operation, `x<op>y=z.`, each starting from the previous result,
  then a newline and `#### z_final`, as GSM8K's answers end. We use GSM8K's plain `*` for
  multiplication and leave out its `<<12+7=19>>` calculator annotations: they would double the
  completion length (the tiny policy writes numbers one digit a token) and carry no
  information the equation does not. A solution is at most 52 characters (48 tokens of the tiny
  policy's tokenizer, plus its end-of-turn token).

Splits. Every problem's arithmetic content -- the start value and the list of (op, operand) -- is
hashed (SHA-256, not Python's salted `hash`); a chain whose hash is 0 mod 10 belongs to "test", every
other chain to "train". The partition is a pure function of the arithmetic, independent of the seed and
of the wording, so a held-out chain is never seen in training under any name, object or phrasing, and
train drawn with one seed is disjoint from test drawn with another.

Determinism. `load(split, n, seed)` draws problems from `random.Random` seeded with (seed, split),
keeps those of the requested split and drops repeated chains. The first n items do not depend on n
(asking for more only appends), so `load("test", 100)` is a prefix of `load("test", 500)`.

How many. There are 12,503,287 distinct chains (count_chains, by dynamic programming over the running
value); hashing every one of them puts 1,251,257 in test and 11,252,030 in train (CHAINS, counted by
count_chains(split) in a minute or so). Drawing at random and dropping repeats finds new chains ever
more slowly as a split fills up, since the rare ones (long subtractions, small products) are seldom
drawn: one new test problem took 15 draws at 10k drawn, 28 at 100k, 126 at 600k
(results/arith_draws.md). So load() gives at most a tenth of a split's chains (MAX_SIZE: 125,125 test,
1,125,203 train) and refuses more at once; asked for more distinct problems than exist, it would draw
forever.
"""

import hashlib
import random
import re

SPLITS = ("train", "test")
DEFAULT_SIZE = {"train": 20000, "test": 500}
TEST_FRACTION = 10  # one chain in TEST_FRACTION is held out
CHAINS = {"train": 11252030, "test": 1251257}  # distinct chains of each split: count_chains(split)
MAX_SIZE = {split: n // 10 for split, n in CHAINS.items()}  # the most load() gives (module docstring)

NAMES = [("Tom", "He"), ("Anna", "She"), ("Ben", "He"), ("Lily", "She"), ("Sam", "He"), ("Mia", "She"),
         ("Jack", "He"), ("Emma", "She"), ("Leo", "He"), ("Zoe", "She"), ("Max", "He"), ("Ava", "She")]
OBJECTS = ["apples", "marbles", "stickers", "coins", "books", "pencils", "cookies", "cards", "shells",
           "stamps", "eggs", "balloons"]
STARTS = ["{name} has {a} {obj}.", "{name} had {a} {obj}.", "{name} starts with {a} {obj}.",
          "{name} collects {a} {obj}."]
PHRASES = {
    "+": ["buys {b} more", "finds {b} more", "gets {b} more from a friend", "picks up {b} more"],
    "-": ["gives away {b}", "loses {b}", "sells {b}", "gives {b} to a friend"],
    "*": ["then has {b} times as many", "ends up with {b} times as many"],
}
QUESTIONS = ["How many {obj} does {name} have now?", "How many {obj} does {name} have in the end?"]

START_RANGE = (2, 20)
ADD_RANGE = (2, 15)
SUB_RANGE = (1, 15)
MUL_RANGE = (2, 4)
MUL_CAP = 200  # a product above this is not offered: keeps every number at 3 digits or fewer


def apply(op, x, y):
    return x + y if op == "+" else x - y if op == "-" else x * y


def split_of(start, ops):
    """The split a chain belongs to: a pure function of its arithmetic (see the module docstring)."""
    key = f"{start}|" + "|".join(f"{op}{y}" for op, y in ops)
    h = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")
    return "test" if h % TEST_FRACTION == 0 else "train"


def _operations(x):
    """Every (op, operand) that may follow the running value x (the rules in the module docstring)."""
    ops = [("+", y) for y in range(ADD_RANGE[0], ADD_RANGE[1] + 1)]
    if x >= 2:
        ops += [("-", y) for y in range(SUB_RANGE[0], min(SUB_RANGE[1], x - 1) + 1)]
    if x * MUL_RANGE[0] <= MUL_CAP:
        ops += [("*", y) for y in range(MUL_RANGE[0], min(MUL_RANGE[1], MUL_CAP // x) + 1)]
    return ops


def chains():
    """Every distinct chain (start, [(op, operand), ...]) that _draw_chain can draw, each once."""
    def grow(start, x, ops):
        if len(ops) >= 2:
            yield start, list(ops)
        if len(ops) < 4:
            for op, y in _operations(x):
                yield from grow(start, apply(op, x, y), ops + [(op, y)])

    for start in range(START_RANGE[0], START_RANGE[1] + 1):
        yield from grow(start, start, [])


def count_chains(split=None):
    """How many distinct chains there are (split None), counted without listing them: the chains of k more
    operations from a running value x are summed over the operations x allows; or how many belong to
    `split`, which needs every chain hashed (count_chains("test") takes a minute or so: CHAINS holds them)."""
    if split is not None:
        return sum(split_of(start, ops) == split for start, ops in chains())
    memo = {}

    def count(x, k):  # chains of exactly k more operations from x
        if k == 0:
            return 1
        if (x, k) not in memo:
            memo[x, k] = sum(count(apply(op, x, y), k - 1) for op, y in _operations(x))
        return memo[x, k]

    return sum(count(start, k) for start in range(START_RANGE[0], START_RANGE[1] + 1) for k in (2, 3, 4))


def _draw_chain(rng):
    """A start value and 2-4 (op, operand) pairs whose running value stays >= 1, with every product
    <= MUL_CAP (additions after a product may pass it)."""
    x = rng.randint(*START_RANGE)
    start, ops = x, []
    for _ in range(rng.randint(2, 4)):
        choices = ["+"]
        if x >= 2:
            choices.append("-")
        if x * MUL_RANGE[0] <= MUL_CAP:
            choices.append("*")
        op = rng.choice(choices)
        if op == "+":
            y = rng.randint(*ADD_RANGE)
        elif op == "-":
            y = rng.randint(SUB_RANGE[0], min(SUB_RANGE[1], x - 1))
        else:
            y = rng.randint(MUL_RANGE[0], min(MUL_RANGE[1], MUL_CAP // x))
        ops.append((op, y))
        x = apply(op, x, y)
    return start, ops


def _render(rng, start, ops):
    """The story (question) and the GSM8K-format solution of one chain."""
    name, pron = rng.choice(NAMES)
    obj = rng.choice(OBJECTS)
    sentences = [rng.choice(STARTS).format(name=name, a=start, obj=obj)]
    i = 0
    while i < len(ops):
        take = 2 if i + 1 < len(ops) and rng.random() < 0.5 else 1
        phrases = [rng.choice(PHRASES[op]).format(b=y) for op, y in ops[i:i + take]]
        sentences.append(f"{pron} " + " and ".join(phrases) + ".")
        i += take
    sentences.append(rng.choice(QUESTIONS).format(obj=obj, name=name))
    steps, x = [], start
    for op, y in ops:
        z = apply(op, x, y)
        steps.append(f"{x}{op}{y}={z}.")
        x = z
    return " ".join(sentences), " ".join(steps) + f"\n#### {x}"


def load(split, n=None, seed=0):
    """`n` problems (default DEFAULT_SIZE[split]) of `split` as [{"question", "answer"}], deterministic
    in (split, seed); the answer is the GSM8K-format solution ending in `#### N`."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n is not None and n < 0:
        raise ValueError(f"n must be >= 0 (how many problems) or None for DEFAULT_SIZE[split], got {n}")
    n = DEFAULT_SIZE[split] if n is None else n
    if n > MAX_SIZE[split]:
        raise ValueError(f"arith's {split} split gives at most {MAX_SIZE[split]} distinct problems (a tenth of its "
                         f"{CHAINS[split]} chains: past that nearly every random draw repeats one already drawn); "
                         f"ask for {MAX_SIZE[split]} or fewer")
    rng = random.Random(f"arith-{seed}-{split}")
    seen, items = set(), []
    while len(items) < n:
        start, ops = _draw_chain(rng)
        key = (start, tuple(ops))
        if key in seen or split_of(start, ops) != split:
            continue
        seen.add(key)
        question, answer = _render(rng, start, ops)
        items.append({"question": question, "answer": answer})
    return items


_EQ = re.compile(r"(\d+)([+\-*])(\d+)=(\d+)\.")


def parse_solution(answer):
    """(steps, final): the equations [(x, op, y, z)] of a solution and its `#### N` value, or None for
    the final when absent. tiny.py grades its held-out accuracy while training the tiny policy with it
    (the gold's final against each completion's); the tests check the equations with it."""
    steps = [(int(x), op, int(y), int(z)) for x, op, y, z in _EQ.findall(answer)]
    m = re.search(r"####\s*(-?\d+)", answer)
    return steps, int(m.group(1)) if m else None


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Print problems of the synthetic arithmetic task with their solutions.")
    p.add_argument("--split", default="train", choices=SPLITS, help="which split to draw from")
    p.add_argument("-n", "--num", type=int, default=5, help="how many problems")
    p.add_argument("--seed", type=int, default=0, help="seed of the draw")
    args = p.parse_args(argv)
    if not 1 <= args.num <= MAX_SIZE[args.split]:
        p.error(f"--num {args.num}: must be in [1, {MAX_SIZE[args.split]}] (MAX_SIZE: the most distinct problems "
                f"the {args.split} split gives)")
    for item in load(args.split, args.num, seed=args.seed):
        print(item["question"], "\n", item["answer"], "\n", sep="")


if __name__ == "__main__":
    main()
