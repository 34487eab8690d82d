"""tasks.py: answer extraction and grading on the real GSM8K / MATH500 golds, hand cases for every
normalization, math-verify off the main thread and under its timeout, rewards, prompts and datasets."""

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
    items = tasks.load_dataset("gsm8k", "test", data_dir=DATA)
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
    items = tasks.load_dataset("gsm8k", "test", data_dir=DATA)
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
    items = tasks.load_dataset("math500", data_dir=DATA)
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
    items = tasks.load_dataset("math500", data_dir=DATA)
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
# math-verify off the main thread and under its timeout
# ------------------------------------------------------------------------------------------------

# Pairs whose normalized strings differ, so the answer comes from math-verify itself.
MV_CASES = [("\\frac{1}{2}", "0.5", True), ("3\\sqrt{2}", "\\sqrt{18}", True), ("[1,2)", "(1,2)", False),
            ("x^2+2x+1", "(x+1)^2", True), ("\\frac{1}{2}", "\\frac{1}{3}", False)]


def test_grade_from_threads_matches_main_thread():
    for gold, pred, _ in MV_CASES:
        assert tasks.normalize_latex(gold) != tasks.normalize_latex(pred)
    main = [tasks.grade("math", f"\\boxed{{{p}}}", g) for g, p, _ in MV_CASES]
    assert main == [e for _, _, e in MV_CASES]
    with ThreadPoolExecutor(2) as pool:
        futs = [pool.submit(tasks.grade, "math", f"\\boxed{{{p}}}", g) for g, p, _ in MV_CASES * 2]
        threaded = [f.result() for f in futs]
    assert threaded == main * 2
    assert tasks._WORKER.pid is not None  # the threads really went through the child process


def test_timeout_grades_false_on_main_thread_and_in_threads():
    # sympy cannot settle 9^(9^(9^9)) == 1 quickly; the 1 s timeout must cut it off, not hang.
    slow = ("9^{9^{9^{9}}}", "\\boxed{1}")
    assert threading.current_thread() is threading.main_thread()
    assert tasks.grade("math", slow[1], slow[0], timeout=1) is False
    result = []
    t = threading.Thread(target=lambda: result.append(tasks.grade("math", slow[1], slow[0], timeout=1)))
    t.start()
    t.join()
    assert result == [False]


def test_stuck_worker_is_killed_and_replaced():
    w = tasks._VerifyWorker()
    try:
        # A 60 s math-verify timeout but only 1 s of patience: the child is killed and the answer False.
        assert w.run("9^{9^{9^{9}}}", "1", timeout=60, wait=1.0) is False
        assert w.pid is None
        assert w.run("\\frac{1}{2}", "0.5", timeout=5) is True  # a fresh child takes over
        assert w.pid is not None
    finally:
        w._stop()


# ------------------------------------------------------------------------------------------------
# Reward
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
def test_reward_parts(kind, completion, gold, signed, fw, total, parts):
    got_total, got_parts = tasks.reward(kind, completion, gold, signed=signed, format_weight=fw)
    assert got_parts == pytest.approx(parts)
    assert got_total == pytest.approx(total) == pytest.approx(sum(got_parts.values()))


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
    with pytest.raises(ValueError):
        tasks.get_task("code")


def test_task_methods_agree_with_functions():
    math = tasks.get_task("math")
    assert math.extract("x \\boxed{\\frac{a}{b}} y") == "\\frac{a}{b}"
    assert math.grade("\\boxed{0.5}", "\\frac{1}{2}")
    assert math.reward("\\boxed{0.5}", "\\frac{1}{2}", signed=True) == (1.0, {"correct": 1.0, "format": 0.0})
    gsm = tasks.get_task("gsm8k")
    assert gsm.extract("#### 1,000") == "1000" and gsm.grade("#### 1,000", "1000")


# ------------------------------------------------------------------------------------------------
# Datasets
# ------------------------------------------------------------------------------------------------

@needs_data
@pytest.mark.parametrize("name, n, kind", [("gsm8k", 1319, "gsm8k"), ("math500", 500, "math"),
                                           ("aime24", 30, "math"), ("amc23", 40, "math")])
def test_named_datasets_from_shared_data(name, n, kind):
    items = tasks.load_dataset(name, "test", data_dir=DATA)
    assert len(items) == n
    raw = [json.loads(line) for line in open(DATA / name / "test.jsonl")]
    for it, r in zip(items, raw):
        assert it["kind"] == kind and it["question"] == r.get("question", r.get("problem"))
        assert it["answer"] and isinstance(it["answer"], str)
    if name == "math500":
        assert {"level", "subject", "id", "solution"} <= set(items[0])
        assert [it["level"] for it in items] == [r["level"] for r in raw]
        assert [it["answer"] for it in items] == [r["answer"] for r in raw]
    if name in ("aime24", "amc23"):  # integer answers (amc23 stores 27.0, aime24 writes 025)
        for it, r in zip(items, raw):
            assert "." not in it["answer"] and int(it["answer"]) == float(r["answer"])
            assert tasks.grade("math", f"\\boxed{{{int(it['answer'])}}}", it["answer"])
            assert not tasks.grade("math", f"\\boxed{{{int(it['answer']) + 1}}}", it["answer"])
    assert tasks.load_dataset(name, "test", limit=7, data_dir=DATA) == items[:7]


@needs_data
def test_gsm8k_train_split_and_env_var(monkeypatch):
    monkeypatch.setenv("QERL_DATA", str(DATA))
    assert tasks.dataset_path("gsm8k", "train") == DATA / "gsm8k" / "train.jsonl"
    train = tasks.load_dataset("gsm8k", "train")
    assert len(train) == 7473 and all(it["kind"] == "gsm8k" for it in train)
    with pytest.raises(ValueError, match="splits"):
        tasks.load_dataset("math500", "train")


def test_plain_jsonl_fields(tmp_path):
    rows = [
        {"question": "Q1", "answer": "He has 3.\n#### 3"},                       # gsm8k style
        {"problem": "Q2", "answer": "\\frac{1}{2}", "level": 3, "subject": "Algebra"},
        {"problem": "Q3", "solution": "It is $\\boxed{\\{1,2\\}}$."},             # gold from the solution
        {"prompt": "Q4", "solution": "2+2=4\n#### 4"},
        {"question": "Q5", "answer": 12, "kind": "gsm8k"},                        # a number; kind given
        {"question": "Q6", "answer": 2.0},
    ]
    path = tmp_path / "mine.jsonl"
    lines = [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines[:3] + [""] + lines[3:]))  # with a blank line
    items = tasks.load_dataset(str(path))
    assert [(it["question"], it["answer"], it["kind"]) for it in items] == [
        ("Q1", "3", "gsm8k"), ("Q2", "\\frac{1}{2}", "math"), ("Q3", "\\{1,2\\}", "math"),
        ("Q4", "4", "gsm8k"), ("Q5", "12", "gsm8k"), ("Q6", "2", "math")]
    assert items[0]["solution"] == rows[0]["answer"] and items[1]["level"] == 3
    assert tasks.grade(items[2]["kind"], "\\boxed{\\{2, 1\\}}", items[2]["answer"])
    assert len(tasks.load_dataset(path, limit=2)) == 2


def test_a_negative_limit_is_refused(tmp_path, monkeypatch, capsys):
    """records[:-1] would drop the last record without a word: a negative limit is an error, from a file
    and from the generated set alike, and the CLI says so; 0 keeps nothing, None everything."""
    path = tmp_path / "few.jsonl"
    path.write_text("\n".join(json.dumps({"question": f"Q{i}", "answer": str(i)}) for i in range(3)))
    for name in (path, "arith"):
        with pytest.raises(ValueError, match="limit must be a whole number >= 0"):
            tasks.load_dataset(name, limit=-1)
        assert tasks.load_dataset(name, limit=0) == []
    with pytest.raises(ValueError, match="limit must be"):
        tasks.read_jsonl(path, limit=-2)
    assert len(tasks.load_dataset(path)) == 3
    monkeypatch.setattr(sys, "argv", ["tasks.py", "--data", str(path), "--limit", "-1"])
    with pytest.raises(SystemExit):
        tasks.main()
    assert "--limit -1: must be >= 1" in capsys.readouterr().err


def test_malformed_lines_are_reported_with_line_numbers(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([
        json.dumps({"question": "ok", "answer": "1"}),
        "",
        '{"question": "broken", "answer": ',                    # line 3: invalid JSON
        json.dumps({"question": "ok", "answer": "2"}),
        json.dumps({"answer": "3"}),                            # line 5: no question
        json.dumps(["not", "an", "object"]),                    # line 6
        json.dumps({"question": "no answer"}),                  # line 7
        json.dumps({"question": "q", "answer": "1", "kind": "poetry"}),  # line 8
    ]) + "\n")
    with pytest.raises(ValueError) as e:
        tasks.load_dataset(str(path))
    msg = str(e.value)
    assert "5 malformed line(s)" in msg
    for line, why in [(3, "invalid JSON"), (5, "no question"), (6, "expected a JSON object"), (7, "no answer"),
                      (8, "unknown kind")]:
        assert f"{path}:{line}: {why}" in msg
    for line in (1, 2, 4):
        assert f"{path}:{line}:" not in msg


def test_offline_without_a_file_names_the_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        tasks.load_dataset("gsm8k", "test", data_dir=tmp_path)
    want = str(tmp_path / "gsm8k" / "test.jsonl")
    assert want in str(e.value) and "offline" in str(e.value)

    monkeypatch.delenv("HF_HUB_OFFLINE")

    def no_network(source, split):
        raise OSError("[Errno -2] Name or service not known")
    monkeypatch.setattr(tasks, "_fetch", no_network)
    with pytest.raises(FileNotFoundError) as e:
        tasks.load_dataset("math500", data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / "math500" / "test.jsonl") in msg and "HuggingFaceH4/MATH-500" in msg
    assert "Name or service not known" in msg
    with pytest.raises(FileNotFoundError, match="neither a dataset name"):
        tasks.load_dataset(str(tmp_path / "missing.jsonl"))


def test_download_picks_the_split_file_and_caches_it(tmp_path, monkeypatch):
    import huggingface_hub
    hub = tmp_path / "hub"
    hub.mkdir()
    rows = [{"problem": "P1", "solution": "s \\boxed{2}", "answer": "2", "subject": "Algebra", "level": 1,
             "unique_id": "a"},
            {"problem": "P2", "solution": "s \\boxed{x}", "answer": "x", "subject": "Algebra", "level": 5,
             "unique_id": "b"}]
    (hub / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    calls = []
    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo_id, repo_type=None, **kw: ["README.md", ".gitattributes", "test.jsonl"])

    def fake_download(repo_id, filename, repo_type=None, **kw):
        calls.append((repo_id, filename, repo_type))
        return str(hub / filename)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    data = tmp_path / "cache"
    items = tasks.load_dataset("math500", data_dir=data)
    assert calls == [("HuggingFaceH4/MATH-500", "test.jsonl", "dataset")]
    assert [(it["question"], it["answer"], it["level"], it["id"]) for it in items] == [
        ("P1", "2", 1, "a"), ("P2", "x", 5, "b")]
    assert (data / "math500" / "test.jsonl").exists()
    monkeypatch.setattr(tasks, "_fetch", lambda *a: pytest.fail("cached file not used"))
    assert tasks.load_dataset("math500", data_dir=data) == items


def test_pick_files_for_hub_layouts():
    gsm = tasks.DATASETS["gsm8k"][1]
    files = ["README.md", "main/test-00000-of-00001.parquet", "main/train-00000-of-00001.parquet",
             "socratic/test-00000-of-00001.parquet"]
    assert tasks._pick_files(files, gsm, "test") == ["main/test-00000-of-00001.parquet"]
    aime = tasks.DATASETS["aime24"][1]
    assert aime.splits["test"] == "train"
    assert tasks._pick_files(["data/train-00000-of-00001.parquet"], aime, "train") == [
        "data/train-00000-of-00001.parquet"]
    amc = tasks.DATASETS["amc23"][1]
    assert tasks._pick_files(["test/0000.parquet", "test.jsonl", "testing.jsonl"], amc, "test") == ["test.jsonl"]
    with pytest.raises(FileNotFoundError):
        tasks._pick_files(["README.md"], amc, "test")


def test_arith_dataset_is_graded_as_gsm8k():
    arith = pytest.importorskip("arith")
    items = tasks.load_dataset("arith", "test", limit=25)
    assert len(items) == 25 and all(it["kind"] == "gsm8k" for it in items)
    raw = arith.load("test", n=25)
    for it, r in zip(items, raw):
        assert it["question"] == r["question"] and it["solution"] == r["answer"]
        assert it["answer"] == str(arith.parse_solution(r["answer"])[1])
        assert tasks.grade("gsm8k", r["answer"], it["answer"])
        assert not tasks.grade("gsm8k", f"#### {int(it['answer']) + 1}", it["answer"])


def test_no_child_process_falls_back_to_grading_in_place(monkeypatch):
    def cannot_start(self):
        raise AssertionError("daemonic processes are not allowed to have children")
    w = tasks._VerifyWorker()
    monkeypatch.setattr(tasks._VerifyWorker, "_start", cannot_start)
    out = []
    t = threading.Thread(target=lambda: out.extend([w.run("\\frac{1}{2}", "0.5", 5), w.run("[1,2)", "(1,2)", 5)]))
    t.start()
    t.join()
    assert out == [True, False] and w.pid is None
