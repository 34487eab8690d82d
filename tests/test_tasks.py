"""tasks.py: answer extraction and grading on the real GSM8K / MATH500 golds, hand cases for every
normalization, strict next to lenient, math-verify under its timeout and off the main thread, the reward
variants (paper, official, strict, lenient) on cases written from the official functions' behaviour,
and the prompt styles."""

import json
import random
import re
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import data  # noqa: E402
import tasks  # noqa: E402

DATA = REPO.parent / "shared" / "data"  # the project's shared test data, next to the repo
needs_data = pytest.mark.skipif(not (DATA / "gsm8k" / "test.jsonl").exists(), reason=f"no test data at {DATA}")


def fresh_rng():
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed {seed}")
    return random.Random(seed), seed


# ------------------------------------------------------------------------------------------------
# The real golds
# ------------------------------------------------------------------------------------------------

@needs_data
def test_every_gsm8k_test_item_is_correct_against_its_own_solution():
    items = data.load_dataset("gsm8k", "test", data_dir=DATA)
    assert len(items) == 1319
    # The number after '####' in the raw file, read independently of tasks.py.
    raw = [json.loads(line)["answer"] for line in open(DATA / "gsm8k" / "test.jsonl")]
    golds = [int(a.split("####")[-1].strip().replace(",", "")) for a in raw]
    assert [it["answer"].replace(",", "") for it in items] == [str(g) for g in golds]
    assert [it["solution"] for it in items] == raw

    own = sum(tasks.grade("gsm8k", it["solution"], it["answer"]) for it in items)
    own_full = sum(tasks.grade("gsm8k", it["solution"], it["solution"]) for it in items)  # gold as text
    print(f"GSM8K test: {own} of {len(items)} gold solutions judged correct")
    assert own == own_full == 1319
    # The same answer written the other ways a model writes it.
    for it, g in zip(items, golds):
        for completion in (f"So the answer is \\boxed{{{g:,}}}", f"In total that is ${g:,}.",
                           f"...\n#### {g}.00", f"The answer is {g} dollars."):
            assert tasks.grade("gsm8k", completion, it["answer"]), (completion, it["answer"])


@needs_data
def test_wrong_gsm8k_answers_are_wrong():
    items = data.load_dataset("gsm8k", "test", data_dir=DATA)
    golds = [int(it["answer"].replace(",", "")) for it in items]
    rng, seed = fresh_rng()
    perm = list(range(len(items)))
    rng.shuffle(perm)
    for i, j in enumerate(perm):
        it = items[i]
        assert not tasks.grade("gsm8k", f"#### {golds[i] + 1}", it["answer"])
        # The body still ends with the right number; the '####' line takes precedence.
        body = it["solution"].rsplit("####", 1)[0]
        assert not tasks.grade("gsm8k", f"{body}#### {golds[i] - 1}", it["answer"])
        assert tasks.grade("gsm8k", f"#### {golds[j]}", it["answer"]) == (golds[i] == golds[j]), seed


@needs_data
def test_math500_gold_solutions_match_gold_answers():
    items = data.load_dataset("math500", data_dir=DATA)
    assert len(items) == 500
    ok = [tasks.grade("math", it["solution"], it["answer"]) for it in items]
    print(f"MATH500: {sum(ok)} of 500 gold solutions' last \\boxed{{}} judged equal to the gold answer; "
          f"failing: {[it['id'] for it, k in zip(items, ok) if not k]}")
    assert sum(ok) >= 495
    # math-verify on its own (no string fast path) agrees on the same pairs.
    mv = [tasks._math_verify(it["answer"], tasks.extract_boxed(it["solution"]), 5) for it in items]
    print(f"MATH500: math-verify alone: {sum(mv)} of 500")
    assert sum(mv) >= 495


def bare(answer):
    """An answer without spaces, degree marks, percent and dollar signs, which the graders ignore by
    design, and with \\frac14 spelled \\frac{1}{4} (MATH500 has "\\$36" and "36", "\\frac14" and
    "\\frac{1}{4}" as golds of different problems: random pairings once matched them)."""
    answer = re.sub(r"\^\{?\\circ\}?|\\%|\\\$|\s", "", answer)
    return re.sub(r"\\frac(\w)(\w)", r"\\frac{\1}{\2}", answer)


# The pairs of different MATH500 gold strings the grader equates, from a scan of all 90,000 ordered pairs
# of its 301 distinct answers (after `bare` and the equation rule below): thousands separators, units,
# reordered solution lists, and two that math-verify decides by its own design (it compares the
# bracketed "(-2,1)" with the list "-2,1" element-wise, and reads "40_9" as 40); those two are noted,
# not changed: the grader is upstream's.
MATH500_EQUAL_BY_DESIGN = {frozenset(p) for p in [
    ("10,\\!080", "10080"), ("15", "15\\mbox{ cm}^2"), ("-2,1", "1,-2"), ("(-2,1)", "-2,1"), ("(-2,1)", "1,-2"),
    ("40", "40_9")]}


@needs_data
def test_wrong_math500_answers_are_wrong():
    items = data.load_dataset("math500", data_dir=DATA)
    rng, seed = fresh_rng()
    perm = list(range(len(items)))
    rng.shuffle(perm)
    wrong_judged_right = []
    for i, j in zip(perm, perm[1:] + perm[:1]):  # every item against another item's answer
        g, other = items[i]["answer"], items[j]["answer"]
        if bare(other) == bare(g):
            continue  # the same answer ("3" and "3", "30" and "30^\\circ"): right by definition
        if ("=" in other) != ("=" in g):
            continue  # math-verify reads an equation's right side as its value ("x = 3" is 3), by design
        if frozenset((g, other)) in MATH500_EQUAL_BY_DESIGN:
            continue
        if tasks.grade("math", f"The answer is $\\boxed{{{other}}}$.", g):
            wrong_judged_right.append((g, other))
    assert wrong_judged_right == [], (seed, wrong_judged_right)
    for it in rng.sample(items, 150):  # the gold plus one is never the gold
        assert not tasks.grade("math", f"\\boxed{{{it['answer']}+1}}", it["answer"]), it["answer"]


# ------------------------------------------------------------------------------------------------
# Hand cases: GSM8K numbers
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, gold, expected", [
    ("#### 1,000", "#### 1000", True),                               # thousands commas
    ("She pays 1,250,000 in all.", "1250000", True),
    ("#### 1000", "... so #### 1,000", True),
    ("It costs $18.", "18", True),                                     # currency, trailing period
    ("It costs \\$18 per day", "18", True),
    ("#### $ 18", "18", True),
    ("The answer is 18 dollars", "18", True),                          # units
    ("Each board is 12 feet long", "12", True),
    ("She makes $18.00 every day.", "#### 18", True),                  # decimals
    ("#### 18.50", "18.5", True),
    ("#### 18.5", "18", False),
    ("The temperature drops to -3 degrees.", "#### -3", True),         # negatives
    ("The temperature drops to \u22123 degrees.", "-3", True),           # Unicode minus
    ("He lost -$5.", "-5", True),
    ("The change is 10-3 = 7", "-3", False),                           # a minus between numbers
    ("The change is 10-3 = 7", "7", True),
    ("#### -3", "3", False),
    ("That is 50%", "50", True),                                       # percent
    ("#### 3/4", "0.75", True),                                        # fractions in answer spots
    ("\\boxed{\\dfrac{3}{4}}", "0.75", True),
    ("#### 7\nbut 8 later", "7", True),                                # order: #### first,
    ("\\boxed{7} and then 8", "7", True),                              # then the last box,
    ("7 then 8", "8", True),                                           # then the last number
    ("#### 7 and \\boxed{8}", "8", False),
    ("\\boxed{5} ... \\boxed{2 \\times 9 = 18} so 3", "18", True),     # last box, last number in it
    ("#### \nno number here, 9", "9", True),                           # '####' with no number: skipped
    ("#### 1{,}000", "1000", True),
    ("x2 items", "2", False),                                          # digits glued to a word
    ("no digits at all", "0", False),
    ("", "5", False),
])
def test_gsm8k_hand_cases(completion, gold, expected):
    assert tasks.grade("gsm8k", completion, gold) is expected


def test_gsm8k_gold_forms():
    assert tasks.grade("gsm8k", "#### 42", 42)
    assert tasks.grade("gsm8k", "#### 42", "Step <<6*7=42>>42\n#### 42")
    with pytest.raises(ValueError, match="no number"):
        tasks.grade("gsm8k", "#### 42", "#### none")
    with pytest.raises(ValueError, match="unknown task kind"):
        tasks.grade("gsm9k", "#### 42", "42")


def test_extract_answer_gsm8k():
    assert tasks.extract_answer("gsm8k", "so #### $1,234.50.") == "1234.5"
    assert tasks.extract_answer("gsm8k", "\\boxed{\\frac{1}{3}}") == "1/3"
    assert tasks.extract_answer("gsm8k", "I give up") is None


# ------------------------------------------------------------------------------------------------
# Hand cases: LaTeX answers
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, content", [
    ("so $\\boxed{\\frac{\\sqrt{3}}{2}}$.", "\\frac{\\sqrt{3}}{2}"),                  # nested braces
    ("\\boxed{1} first, then \\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),                   # the LAST box; \{ literal
    ("\\fbox{x^{2}}", "x^{2}"),
    ("\\boxed {7}", "7"),
    ("\\boxed 5$", "5"),
    ("\\boxed{\\text{(C)}} end", "\\text{(C)}"),
    ("\\boxed{\\left\\{ 1 \\right.}", "\\left\\{ 1 \\right."),                     # unbalanced \{ is literal
    ("\\boxed{3} then \\boxed{\\frac{1}{2", None),                                  # cut off: no answer
    ("no box here: 3", None),
    ("\\boxedfoo{3}", None),
])
def test_extract_boxed(text, content):
    assert tasks.extract_boxed(text) == content


@pytest.mark.parametrize("raw, norm", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\tfrac12", "\\frac12"),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\frac{\\pi}{2})"),
    ("\\text{Monday}", "Monday"),
    ("\\text{\\textbf{(B)}}", "(B)"),
    ("30^\\circ", "30"),
    ("30^{\\circ}", "30"),
    ("45\\%", "45"),
    ("\\$5.50", "5.50"),
    ("$x = 5$.", "x=5"),
    ("1{,}000", "1,000"),
    ("a\\,b\\!c\\;d", "abcd"),
    ("\\leftarrow", "\\leftarrow"),
])
def test_normalize_latex(raw, norm):
    assert tasks.normalize_latex(raw) == norm


@pytest.mark.parametrize("pred, gold, expected", [
    ("\\dfrac{1}{2}", "\\frac{1}{2}", True),                 # dfrac / frac
    ("\\frac12", "\\dfrac{1}{2}", True),
    ("0.5", "\\frac{1}{2}", True),
    ("\\frac{1}{3}", "\\frac{1}{2}", False),
    ("\\text{Evelyn}", "\\text{Evelyn}", True),              # \text{}
    ("Evelyn", "\\text{Evelyn}", True),
    ("\\text{Bob}", "\\text{Evelyn}", False),
    ("\\text{(C)}", "\\text{(C)}", True),
    ("10", "10\\text{ inches}", True),                       # units
    ("30", "30^\\circ", True),                               # degrees
    ("30^{\\circ}", "30^\\circ", True),
    ("60^\\circ", "30^\\circ", False),
    ("25\\%", "25", True),                                   # percent
    ("26\\%", "25", False),
    ("[1, 2)", "[1,2)", True),                               # intervals
    ("\\left[ 1, 2 \\right)", "[1,2)", True),
    ("(1, 2)", "[1,2)", False),
    ("(-\\infty, 3]", "(-\\infty,3]", True),
    ("(-\\infty, 3)", "(-\\infty,3]", False),
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3, \\frac{\\pi}{2})", True),   # \left( \right), tuples
    ("(3, \\pi)", "\\left( 3, \\frac{\\pi}{2} \\right)", False),
    ("\\sqrt{18}", "3\\sqrt{2}", True),                      # symbolic equivalence
    ("(x+1)^2", "x^2+2x+1", True),
    ("x = 5", "5", True),                                    # an equation's right side
    ("-3", "3", False),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("\\begin{pmatrix} 1 \\\\ 3 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", False),
    ("\\$18.00", "18", True),
    ("3.14", "\\pi", False),
])
def test_math_hand_cases(pred, gold, expected):
    assert tasks.grade("math", f"Thus the answer is $\\boxed{{{pred}}}$.", gold) is expected


def test_math_needs_a_box_and_gold_may_be_a_solution():
    assert not tasks.grade("math", "The answer is 5.", "5")       # no box: no answer
    assert not tasks.grade("math", "\\boxed{}", "5")
    assert not tasks.grade("math", "\\boxed{5", "5")                # cut off mid-box
    assert tasks.grade("math", "\\boxed{5}", "so the total is $\\boxed{5}$.")
    assert tasks.grade("math", "\\boxed{4} no wait \\boxed{5}", "5")
    assert not tasks.grade("math", "\\boxed{5} no wait \\boxed{4}", "5")


# ------------------------------------------------------------------------------------------------
# Strict and lenient grading
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, lenient, strict", [
    ("Adding them up gives 18 apples.", True, False),  # the last number anywhere: lenient only
    ("So the total is \\boxed{18}.", True, False),  # a box is not what the GSM8K prompt asks for
    ("12 + 6 = 18\n#### 18", True, True),
    ("#### 1,8", False, False),
    ("<think>12 + 6 = 18</think>\n<answer>\n18\n</answer>", True, True),
    ("<answer>$18.00</answer>", True, True),  # the value, not the string (the official code: string)
    ("<answer>17</answer> or maybe 18", False, False),  # an explicit answer wins over later numbers
    ("<answer>18", True, False),  # an unclosed tag is no answer; lenient still finds the number
    ("<answer>eighteen</answer>", False, False),
    ("#### 17\n<answer>18</answer>", False, False),  # `####` first, as its prompt asks
])
def test_gsm8k_strict_and_lenient(completion, lenient, strict):
    assert tasks.grade("gsm8k", completion, "Janet ... #### 18") is lenient
    assert tasks.grade("gsm8k", completion, "18", strict=True) is strict
    assert strict <= lenient  # whatever strict accepts, lenient accepts


@pytest.mark.parametrize("completion, ok", [
    ("so it is \\boxed{\\frac{7}{8}}", True),
    ("<think>3/4 + 1/8</think><answer>\\frac{7}{8}</answer>", True),
    ("<answer>the sum is \\boxed{0.875}</answer>", True),
    ("The answer is 7/8.", False),  # no box, no tag: no answer, in either mode
    ("\\boxed{}", False),
])
def test_math_needs_an_explicit_answer_in_both_modes(completion, ok):
    assert tasks.grade("math", completion, "\\frac{7}{8}") is ok
    assert tasks.grade("math", completion, "\\frac{7}{8}", strict=True) is ok


def official_gsm8k_correct(completion, gold):
    """The official GSM8K correctness rule, written from its description: the text after the last
    `<answer>` up to the next `</answer>` (the whole text when there is no tag), stripped, equal to
    the gold string."""
    return completion.split("<answer>")[-1].split("</answer>")[0].strip() == gold


def test_strict_gsm8k_agrees_with_the_official_rule_on_integers():
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    forms = ["<think>{w}</think>\n<answer>\n{a}\n</answer>", "<think>{w}</think> <answer>{a}</answer>",
             "{w} the answer is {a}", "<answer>{a}</answer>\n{w} {b}", "{w}"]
    for _ in range(300):
        gold, other = rng.randrange(10**4), rng.randrange(10**4)
        a = rng.choice([gold, other])
        text = rng.choice(forms).format(w=f"{rng.randrange(99)} + {rng.randrange(99)}", a=a, b=other)
        ours = tasks.grade("gsm8k", text, str(gold), strict=True)
        if "<answer>" in text or text.strip() == str(gold):
            assert ours == official_gsm8k_correct(text, str(gold)), (seed, text, gold)
        else:  # no tag: officially right only if the whole text is the number; strictly wrong here
            assert not ours, (seed, text, gold)


def test_extract_answer_strict():
    assert tasks.extract_answer("gsm8k", "we get 7 and then 9") == "9"
    assert tasks.extract_answer("gsm8k", "we get 7 and then 9", strict=True) is None
    assert tasks.extract_answer("gsm8k", "<answer> 1,250 </answer>", strict=True) == "1250"
    assert tasks.extract_answer("math", "<answer>x^2</answer>") == "x^2"
    assert tasks.extract_answer_tag("<answer>a</answer> <answer> b </answer>") == "b"
    assert tasks.extract_answer_tag("<answer>a") is None


# ------------------------------------------------------------------------------------------------
# math-verify under its timeout, and off the main thread
# ------------------------------------------------------------------------------------------------

# Pairs whose normalized strings differ, so the answer comes from math-verify itself.
MV_CASES = [("\\frac{1}{2}", "0.5", True), ("3\\sqrt{2}", "\\sqrt{18}", True), ("[1,2)", "(1,2)", False),
            ("x^2+2x+1", "(x+1)^2", True), ("\\frac{1}{2}", "\\frac{1}{3}", False)]


def test_off_the_main_thread_math_needs_timeout_none():
    """math-verify's timeout is signal.alarm, main thread only: from a thread, grading math with a timeout
    is refused in one line that says what to do, and timeout=None gives the main thread's answers."""
    for gold, pred, _ in MV_CASES:
        assert tasks.normalize_latex(gold) != tasks.normalize_latex(pred)
    main = [tasks.grade("math", f"\\boxed{{{p}}}", g) for g, p, _ in MV_CASES]
    assert main == [e for _, _, e in MV_CASES]
    with ThreadPoolExecutor(2) as pool:
        threaded = list(pool.map(lambda c: tasks.grade("math", f"\\boxed{{{c[1]}}}", c[0], timeout=None), MV_CASES))
        assert threaded == main
        with pytest.raises(ValueError, match="off the main thread.*timeout=None"):
            pool.submit(tasks.grade, "math", "\\boxed{0.5}", "\\frac{1}{2}").result()
        # Equal strings never reach math-verify, and gsm8k never uses it: both fine on any thread.
        assert pool.submit(tasks.grade, "math", "\\boxed{\\dfrac{1}{2}}", "\\frac{1}{2}").result()
        assert pool.submit(tasks.grade, "gsm8k", "#### 18", "18").result()


def test_timeout_grades_false_on_the_main_thread():
    # sympy cannot settle 9^(9^(9^9)) == 1 quickly; the 1 s timeout must cut it off, not hang.
    assert threading.current_thread() is threading.main_thread()
    assert tasks.grade("math", "\\boxed{1}", "9^{9^{9^{9}}}", timeout=1) is False


# ------------------------------------------------------------------------------------------------
# Rewards: ours (strict, lenient)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, completion, gold, signed, fw, total, parts", [
    ("gsm8k", "2+2=4\n#### 4", "4", False, 0.0, 1.0, {"correct": 1.0, "format": 0.0}),
    ("gsm8k", "2+2=4\n#### 4", "4", False, 0.25, 1.25, {"correct": 1.0, "format": 0.25}),
    ("gsm8k", "2+2 is 4", "4", False, 0.25, 1.0, {"correct": 1.0, "format": 0.0}),     # right, no ####
    ("gsm8k", "#### 5", "4", False, 0.25, 0.25, {"correct": 0.0, "format": 0.25}),      # wrong, formatted
    ("gsm8k", "#### 5", "4", True, 0.0, -1.0, {"correct": -1.0, "format": 0.0}),        # DAPO's +-1
    ("gsm8k", "#### 4", "4", True, 0.5, 1.5, {"correct": 1.0, "format": 0.5}),
    ("gsm8k", "no idea", "4", True, 0.5, -1.0, {"correct": -1.0, "format": 0.0}),
    ("math", "so $\\boxed{\\dfrac{1}{2}}$", "\\frac12", True, 0.1, 1.1, {"correct": 1.0, "format": 0.1}),
    ("math", "so it is 1/2", "\\frac12", True, 0.1, -1.0, {"correct": -1.0, "format": 0.0}),
    ("math", "\\boxed{3}", "\\frac12", False, 0.1, 0.1, {"correct": 0.0, "format": 0.1}),
])
def test_lenient_reward_parts(kind, completion, gold, signed, fw, total, parts):
    got_total, got_parts = tasks.reward(kind, completion, gold, "lenient", signed=signed, format_weight=fw)
    assert got_parts == pytest.approx(parts)
    assert got_total == pytest.approx(total) == pytest.approx(sum(got_parts.values()))
    assert tasks.reward(kind, completion, gold, signed=signed, format_weight=fw) == (got_total, got_parts)  # default


@pytest.mark.parametrize("completion, variant, prompt, total, correct, fmt", [
    ("<think>6+12</think>\n<answer>18</answer>", "strict", "official", 1.1, 1.0, 0.1),
    ("<answer>18</answer>", "strict", "official", 1.0, 1.0, 0.0),  # official format needs the think tags too
    ("<answer>18</answer>", "strict", "ours", 1.1, 1.0, 0.1),  # ours: an explicit answer spot
    ("The total is 18.", "strict", "ours", 0.0, 0.0, 0.0),
    ("The total is 18.", "lenient", "ours", 1.0, 1.0, 0.0),
    ("<think>x</think><answer>17</answer>", "strict", "official", 0.1, 0.0, 0.1),  # format paid alone
    ("#### 17", "strict", "ours", 0.1, 0.0, 0.1),
    ("<think>6+12</think>\n#### 18", "strict", "paper", 1.1, 1.0, 0.1),  # paper asks for the think block
    ("6+12\n#### 18", "strict", "paper", 1.0, 1.0, 0.0),
])
def test_strict_and_lenient_reward_total_and_parts(completion, variant, prompt, total, correct, fmt):
    got, parts = tasks.reward("gsm8k", completion, "18", variant, format_weight=0.1, prompt=prompt)
    assert parts == {"correct": correct, "format": pytest.approx(fmt)}
    assert got == pytest.approx(total) == pytest.approx(parts["correct"] + parts["format"])
    signed, sp = tasks.reward("gsm8k", completion, "18", variant, signed=True, prompt=prompt)
    assert sp["correct"] == (1.0 if correct else -1.0) and sp["format"] == 0.0 and signed == sp["correct"]


def test_math_reward_strict_official_format():
    text = "<think>r = 2, so pi r^2</think>\n<answer>\\boxed{4\\pi}</answer>"
    total, parts = tasks.reward("math", text, "4\\pi", "strict", format_weight=0.2, prompt="official")
    assert parts == {"correct": 1.0, "format": pytest.approx(0.2)} and total == pytest.approx(1.2)
    # The paper prompt asks math problems with the official system prompt: the same form.
    assert tasks.reward("math", text, "4\\pi", "strict", format_weight=0.2, prompt="paper") == (total, parts)
    assert tasks.reward("math", "\\boxed{4\\pi}", "4\\pi", "strict", format_weight=0.2, prompt="paper")[0] == 1.0


# ------------------------------------------------------------------------------------------------
# Rewards: paper (NVlabs/QeRL 1bf4803) and official (e8c6e79), on cases written from their behaviour
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, gold, correct, fmt", [
    ("<think>6 + 12 = 18</think>\n#### 18", "18", 1.0, 0.2),               # right, in the asked form
    ("6 + 12 = 18\n#### 18", "18", 1.0, 0.0),                                # right, no think block
    ("<think>6 + 12 = 17</think>\n#### 17", "18", 0.0, 0.2),                 # wrong: the format alone
    ("<think>6 + 12</think>", "18", 0.0, 0.2),                               # tags only
    ("<think></think>\n#### 18", "18", 1.0, 0.0),                            # an empty block pays nothing
    ("<think>6 + 12 = 18\n#### 18", "18", 1.0, 0.0),                         # think never closed
    ("#### 18.00", "18", 0.0, 0.0),                                          # a string compare: 18.00 != 18
    ("#### 18.", "18", 0.0, 0.0),                                            # the period is in the run
    ("####18", "18", 0.0, 0.0),                                              # one space after #### or nothing
    ("####  18", "18", 0.0, 0.0),
    ("#### $18", "18", 0.0, 0.0),
    ("#### 1,080", "1080", 1.0, 0.0),                                        # commas dropped from the answer
    ("#### 1,080", "1,080", 0.0, 0.0),                                       # ... not from the gold: never right
    ("#### -3", "-3", 1.0, 0.0),
    ("#### 18\nno, wait\n#### 17", "18", 0.0, 0.0),                          # the last `#### ` counts
    ("#### 17\nno, wait\n#### 18", "18", 1.0, 0.0),
    ("<think>6 + 12</think><answer>18</answer>", "18", 0.0, 0.2),            # answer in the wrong place
    ("So the answer is \\boxed{18}.", "18", 0.0, 0.0),
    ("The answer is 18", "18", 0.0, 0.0),
    ("<think>x</think>\n#### 18", "Janet sells 16 - 3 - 4 = 9 ... #### 18", 1.0, 0.2),  # gold as a solution
])
def test_paper_reward_gsm8k(completion, gold, correct, fmt):
    total, parts = tasks.reward("gsm8k", completion, gold, "paper")
    assert parts == {"correct": correct, "format": fmt}
    assert total == pytest.approx(correct + fmt)


@pytest.mark.parametrize("completion, correct, fmt", [
    ("<think>6 + 12</think>\n<answer>\n18\n</answer>", 2.0, 0.2),           # right, in the asked form
    ("<think>6 + 12</think> <answer>18</answer>", 2.0, 0.2),
    ("<think>6 + 12</think><answer>17</answer>", 0.0, 0.2),                  # wrong: the format alone
    ("<think></think><answer></answer>", 0.0, 0.2),                          # tags only (empty tags count)
    ("<think>x</think><answer>The answer is 18</answer>", 0.0, 0.2),         # extra text in the tag
    ("<answer>18.0</answer>", 0.0, 0.0),                                     # a string compare
    ("<answer>$18</answer>", 0.0, 0.0),
    ("18", 2.0, 0.0),                                                        # no tag: the whole text
    ("  18 \n", 2.0, 0.0),
    ("12 + 6 = 18", 0.0, 0.0),
    ("#### 18", 0.0, 0.0),                                                   # answer in the wrong place
    ("<think>x</think><answer>18", 2.0, 0.0),                                # unclosed answer tag: read to the end
    ("<think>x<answer>18</answer>", 2.0, 0.0),                               # think never closed
    ("<answer>18</answer> and some more text", 2.0, 0.0),
    ("<answer>18</answer><answer>17</answer>", 0.0, 0.0),                    # the last tag counts
    ("<answer>17</answer><answer>18</answer>", 2.0, 0.0),
])
def test_official_reward_gsm8k(completion, correct, fmt):
    total, parts = tasks.reward("gsm8k", completion, "18", "official")
    assert parts == {"correct": correct, "format": fmt}
    assert total == pytest.approx(correct + fmt)


@pytest.mark.parametrize("completion, correct, fmt", [
    ("<think>r</think>\n<answer>\\boxed{0.5}</answer>", 1.0, 0.2),
    ("<think>r</think><answer>\\frac{1}{2}</answer>", 1.0, 0.2),             # the tag read when there is no box
    ("so \\boxed{\\dfrac12}", 1.0, 0.0),
    ("<think>r</think><answer>\\frac{1}{3}</answer>", 0.0, 0.2),
    ("<think>r</think>", 0.0, 0.0),
    ("The final answer is 1/2", 0.0, 0.0),                                   # no box, no tag: no answer here
])
def test_paper_and_official_math_reward_is_the_bigmath_one(completion, correct, fmt):
    for variant in ("paper", "official"):
        total, parts = tasks.reward("math", completion, "\\frac{1}{2}", variant)
        assert parts == {"correct": correct, "format": fmt}, variant
        assert total == pytest.approx(correct + fmt)


def paper_rule(text, gold):
    """The 1bf4803 GSM8K correctness, restated by hand from its description: after each `#### `, an
    optional `-` and a run of digits, points and commas; the last run, commas dropped, equals the gold."""
    runs = []
    for piece in text.split("#### ")[1:]:
        i = 1 if piece[:1] == "-" else 0
        j = i
        while j < len(piece) and piece[j] in "0123456789.,":
            j += 1
        if j > i:
            runs.append(piece[:j])
    return bool(runs) and runs[-1].replace(",", "") == gold


def test_paper_and_official_rewards_agree_with_their_rules_on_random_texts():
    seed = random.SystemRandom().randrange(2**32)
    rng = random.Random(seed)
    forms = ["<think>{w}</think>\n#### {a}", "#### {a}.", "####{a}", "#### {a:,}", "#### ${a}",
             "{w} #### {a}\n#### {b}", "#### {a}.00", "#### -{a}", "<answer>{a}</answer>",
             "<think>{w}</think> <answer>{a}</answer> {b}", "{a}", "<answer>{a}", "<answer> {a:,} </answer>",
             "#### #### {a}", "<think></think>#### {a}", "{w}"]
    for _ in range(400):
        gold, other = rng.randrange(10**5), rng.randrange(10**5)
        a = rng.choice([gold, other])
        text = rng.choice(forms).format(w=f"{rng.randrange(99)} + {rng.randrange(99)}", a=a, b=other)
        g = rng.choice([str(gold), f"{gold:,}"])  # GSM8K golds sometimes carry thousands commas
        paper = tasks.reward("gsm8k", text, g, "paper")[1]["correct"]
        official = tasks.reward("gsm8k", text, g, "official")[1]["correct"]
        assert paper == (1.0 if paper_rule(text, g) else 0.0), (seed, text, g)
        assert official == (2.0 if official_gsm8k_correct(text, g) else 0.0), (seed, text, g)


def test_the_reward_table():
    for name, r in tasks.REWARDS.items():
        assert set(r.correct) == set(r.format) == set(r.prompt) == set(tasks.KINDS), name
        assert all(style in tasks.PROMPT_STYLES for style in r.prompt.values()), name
        assert r.source and r.grading and r.form
    paper, official = tasks.REWARDS["paper"], tasks.REWARDS["official"]
    official_kinds = lambda d: {k: d[k] for k in ("gsm8k", "math")}  # (countdown: ours alone, below)
    assert (official_kinds(paper.correct), official_kinds(paper.format)) == ({"gsm8k": 1.0, "math": 1.0},
                                                                            {"gsm8k": 0.2, "math": 0.2})
    assert (official_kinds(official.correct), official_kinds(official.format)) == ({"gsm8k": 2.0, "math": 1.0},
                                                                                  {"gsm8k": 0.2, "math": 0.2})
    assert official_kinds(paper.prompt) == {"gsm8k": "paper", "math": "paper"} and "1bf4803" in paper.source
    assert official_kinds(official.prompt) == {"gsm8k": "bare", "math": "official"} and "e8c6e79" in official.source
    assert set(tasks.OURS) == {"strict", "lenient"} <= set(tasks.REWARDS)


def test_countdown_is_graded_by_its_own_file_and_only_by_ours():
    """The countdown kind: countdown.grade decides (strict, whatever the variant of ours), the answer is read
    as countdown.extract reads it, and the official variants, GSM8K's and BigMath's, refuse it."""
    import countdown

    gold = "25 4 7 3 -> 96 : ((25*4)-7)+3"
    right, wrong = "25*4=100\n100-7=93\n93+3=96\n#### ((25*4)-7)+3", "#### 25*4-7"
    for variant in tasks.OURS:
        assert tasks.reward("countdown", right, gold, variant) == (1.0, {"correct": 1.0, "format": 0.0})
        assert tasks.reward("countdown", wrong, gold, variant)[0] == 0.0
    assert tasks.grade("countdown", right, gold) and not tasks.grade("countdown", wrong, gold)
    assert tasks.extract_answer("countdown", right) == countdown.extract(right)
    assert tasks.has_final_answer("countdown", wrong) and not tasks.has_final_answer("countdown", "96")
    for variant in ("paper", "official"):
        with pytest.raises(ValueError, match="a countdown problem is graded by --reward strict"):
            tasks.reward("countdown", right, gold, variant)


@pytest.mark.parametrize("variant, kw, message", [
    ("nope", {}, "unknown reward variant 'nope'; variants are paper, official, strict, lenient"),
    ("paper", {"signed": True}, "the paper reward pays as its source does (1 right, 0.2 format)"),
    ("official", {"format_weight": 0.1}, "the official reward pays as its source does (2 right, 0.2 format)"),
    ("strict", {"format_weight": 0.1, "prompt": "bare"}, "the bare prompt asks for no answer form"),
    ("strict", {"format_weight": -0.1}, "format weight -0.1: must be a finite number >= 0"),
    ("lenient", {"format_weight": float("nan")}, "format weight nan: must be a finite number >= 0"),
    ("lenient", {"prompt": "boxed"}, "unknown prompt style 'boxed'"),
])
def test_bad_rewards_are_refused_in_one_line(variant, kw, message):
    with pytest.raises(ValueError) as e:
        tasks.check_reward(variant, **kw)
    assert message in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        tasks.reward("gsm8k", "#### 4", "4", variant, **kw)


def test_bare_prompt_with_no_format_weight_is_fine():
    assert tasks.reward("gsm8k", "4", "4", "lenient", prompt="bare") == (1.0, {"correct": 1.0, "format": 0.0})
    assert tasks.reward("gsm8k", "4", "4", "strict", format_weight=0.0, prompt="bare")[0] == 0.0
    with pytest.raises(ValueError, match="asks for no answer form"):
        tasks.asked_form("gsm8k", "4", "bare")


# ------------------------------------------------------------------------------------------------
# Tasks and prompts
# ------------------------------------------------------------------------------------------------

def test_build_prompt_with_a_real_chat_template():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"[UNK]": 0}, unk_token="[UNK]")))
    tok.chat_template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                         "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    q = "  What is 2+3?\n"
    math = tasks.get_task("math")
    assert math.instruction == "Please reason step by step, and put your final answer within \\boxed{}."
    assert math.build_prompt(tok, q) == (
        "<|user|>What is 2+3?\nPlease reason step by step, and put your final answer within \\boxed{}."
        "<|end|><|assistant|>")
    gsm = tasks.get_task("gsm8k")
    assert gsm.build_prompt(tok, q) == f"<|user|>What is 2+3?\n{tasks.GSM8K_INSTRUCTION}<|end|><|assistant|>"
    assert "####" in tasks.GSM8K_INSTRUCTION
    assert tasks.get_task("gsm8k", "official").build_prompt(tok, q) == (
        f"<|system|>{tasks.OFFICIAL_SYSTEM_PROMPT}<|end|><|user|>What is 2+3?<|end|><|assistant|>")
    with pytest.raises(ValueError):
        tasks.get_task("code")


def test_prompt_styles_messages():
    q = "  What is 2+2? "
    official = tasks.get_task("gsm8k", prompt="official").messages(q)
    assert [m["role"] for m in official] == ["system", "user"] and official[1]["content"] == "What is 2+2?"
    assert "<think> </think>" in official[0]["content"] and "<answer> </answer>" in official[0]["content"]
    ours = tasks.get_task("gsm8k").messages(q)
    assert ours == [{"role": "user", "content": f"What is 2+2?\n{tasks.GSM8K_INSTRUCTION}"}]
    # paper: GSM8K asked with the think/#### instruction after the question; math with the system prompt.
    paper = tasks.get_task("gsm8k", prompt="paper").messages(q)
    assert paper == [{"role": "user", "content": f"What is 2+2?\n{tasks.PAPER_GSM8K_INSTRUCTION}"}]
    assert tasks.PAPER_GSM8K_INSTRUCTION.startswith("Let's think step by step first within <think> </think> tags")
    assert tasks.PAPER_GSM8K_INSTRUCTION.endswith("#     #### number")
    assert "<answer>" not in tasks.PAPER_GSM8K_INSTRUCTION
    assert tasks.get_task("math", prompt="paper").messages(q) == tasks.get_task("math", prompt="official").messages(q)
    # bare: the question alone, for both kinds.
    for kind in tasks.KINDS:
        assert tasks.get_task(kind, prompt="bare").messages(q) == [{"role": "user", "content": "What is 2+2?"}]
    assert tasks.PROMPT_STYLES == ("ours", "paper", "official", "bare")
    with pytest.raises(ValueError, match="prompt style"):
        tasks.get_task("math", prompt="boxed")


def test_each_reward_asks_with_a_prompt_that_asks_for_what_it_pays():
    """The paper reward's prompt asks for the think block and `####` it pays for; the official reward's
    GSM8K prompt (HEAD's) asks for nothing, though its reward pays for tags: that is HEAD's code."""
    paper_gsm8k = tasks.get_task("gsm8k", tasks.REWARDS["paper"].prompt["gsm8k"]).messages("q")
    assert "<think> </think>" in paper_gsm8k[-1]["content"] and '"####"' in paper_gsm8k[-1]["content"]
    assert tasks.get_task("gsm8k", tasks.REWARDS["official"].prompt["gsm8k"]).messages("q") == [
        {"role": "user", "content": "q"}]
    for variant in ("paper", "official"):
        math = tasks.get_task("math", tasks.REWARDS[variant].prompt["math"]).messages("q")
        assert math[0] == {"role": "system", "content": tasks.OFFICIAL_SYSTEM_PROMPT}
