"""Tasks, answer grading, rewards and datasets: the text side of RL on math problems.

RL with verifiable rewards needs three things from a problem set: a prompt for each question, a way to
read the model's final answer out of free text, and a judge that says whether that answer equals the
gold one. This file owns all three, and the datasets they apply to. It imports no model code.

Two kinds of grading
--------------------
"gsm8k" -- the answer is a number. Gold is a dataset answer ending in `#### N` (GSM8K's solutions) or
the bare number. From a completion we take, in this order:
    1. the number after its last `####` (the form our GSM8K prompt asks for),
    2. else the first number inside its last closed `<answer>...</answer>` (the official prompt's form),
    3. else the last number inside its last `\\boxed{}` (models trained on MATH box by habit),
    4. else the last number anywhere in the text.
The lenient grader (the default) uses all four; the strict one (`strict=True`) only 1 and 2, so an
answer counts only where the prompt asked for it and the format has to be learned.
Numbers are read forgivingly and compared exactly as rationals: `1,000` (thousands commas), `$18`,
`\\$18`, `18 dollars`, `18.` (trailing period), `18.00` == `18`, `-3` (and the Unicode minus),
`50%` == `50` (GSM8K's gold is the bare number of percent), `\\frac{3}{4}` and `3/4` in the two explicit
answer spots. Comparison is exact (Fraction), not float-close: GSM8K answers are short decimals.

"math" -- gold is a LaTeX answer (MATH500 `answer`, AIME/AMC integers, BigMath / DAPO-Math `solution`); a
gold that still contains a `\\boxed{}` (a whole solution) is reduced to its last box. From a completion we
take the content of the LAST `\\boxed{...}` (or `\\fbox{...}`), with nested braces matched, else that of
its last closed `<answer>` tag; none of these, or a box cut off before its closing brace, means no
answer. This is strict already, so both modes grade math alike: a LaTeX answer has no "last number".
Gold and answer are then judged by
    1. a string match after light normalization (`\\dfrac`->`\\frac`, no `\\left`/`\\right`, spacing,
       `\\text{}` wrappers, degrees, percent and dollar signs, trailing period), which is fast and catches
       most equal answers, else
    2. symbolic equivalence with math-verify (`math_verify.parse` + `verify`, the library TRL, open-r1
       and the official QeRL reward use): sympy equality, numeric closeness, intervals, sets, tuples,
       matrices, equations `x=5` vs `5`, units and percent.
math-verify bounds each parse and comparison with a `signal.alarm` timeout, and signals only work on the
main thread: called from any other thread it raises. So off the main thread we run it in a child
process (spawned once, reused; its own main thread keeps math-verify's timeouts), and if the child does
not answer within a generous deadline we kill it, respawn it on the next call and grade False. Calls
from threads are serialized through that one child. (Spawning re-imports the caller's main script, as
multiprocessing always does: scripts keep their work under `if __name__ == "__main__":`.)

Prompts
-------
A Task is a kind plus its instruction, appended to the user's question in a single user message (every
chat template has a user role; not all have a system role), then rendered with the tokenizer's chat
template and the assistant header (`add_generation_prompt=True`).
- math: "Please reason step by step, and put your final answer within \\boxed{}." -- the paper's setup
  for MATH-style data (also Qwen2.5-Math's and DeepSeek-R1's evaluation prompt).
- gsm8k: step by step, the final answer after `####` (GSM8K's own solution format).
- prompt="official" (`get_task(kind, prompt="official")`): the official QeRL system prompt
  (OFFICIAL_SYSTEM_PROMPT: reasoning in `<think> </think>`, the answer in `<answer> </answer>`) and
  the bare question as the user message, as the official code asks BigMath problems and evaluates
  GSM8K (its GSM8K *training* prompt is the bare question alone: the system prompt is commented out,
  so the tags that its reward pays for are never asked for).
The synthetic `arith` task (arith.py) is graded and prompted as gsm8k.

Reward
------
`reward(kind, completion, gold, *, strict=False, signed=False, format_weight=0.0, prompt="ours")
-> (total, parts)` (the options keyword-only):
    correct = 1 if grade(..., strict) else 0   (signed=True: +1 / -1, the DAPO recipe's accuracy reward)
    format  = format_weight * [prompt "ours": the completion gave a final answer in an explicit spot
                               (has_final_answer: `#### N` / `<answer>` for gsm8k, a closed non-empty
                               `\\boxed{}` / `<answer>` for math);
                               prompt "official": `<think>...</think>` then `<answer>...</answer>`
                               (think_answer_format, the official soft format reward)]
    total   = correct + format,  parts = {"correct": ..., "format": ...}

What the official code trains with, and what the paper reports (NVlabs/QeRL; results/recipe.md):
- GSM8K training is strict: 2.0 if the text inside the answer tags equals the gold string exactly (the
  whole completion when it has no tag), plus 0.2 for the think/answer tags. Our strict mode with
  prompt="official" and format_weight=0.1 is that reward halved, which advantages divided by the
  group's reward std do not see; we compare values, not strings (`18.00`, `$18` and `1,000` are
  right), and a completion that is the bare number, with no tag, is wrong here.
- BigMath training: 1.0 from math-verify with boxed answers tried first and its fallback turned off
  (try_extract_without_anchor=False), so the answer is read only where something marks it as one (a
  `\\boxed{}`, "final answer is", "answer:"), never taken from the last expression found anywhere in
  the text; plus the same 0.2 format reward: strict mode, prompt="official", format_weight=0.2.
  DAPO-Math: 1.0 for DAPO's last-line `Answer: X` (string match after normalization), no format
  reward; we ask and grade it as every math problem (\\boxed{}, math-verify), format_weight=0.
- Reported numbers: trained models' GSM8K through the official eval script (the official prompt,
  the answer read from the tags: strict, but see eval.py for its first-character comparison); base
  models' GSM8K through lm-eval, which prints both its strict `#### N` match and its flexible last-
  number match; MATH500 / AIME / AMC through lighteval's math-verify, which reads the final answer
  wherever the completion states it (lenient about format). eval.py reports both of ours side by side.

Datasets
--------
`load_dataset(name_or_path, split="test", limit=None, data_dir=None)` returns a list of records
    {"question": str, "answer": str (the short gold answer that `grade` takes), "kind": "gsm8k"|"math",
     "solution": str (worked solution, when the source has one), "id", "level", "subject" (when present)}
Named sets: gsm8k (train/test), math500, aime24, amc23 (test; the AIME set's only hub split is "train"),
arith (train/test, generated), and the paper's training sets (train only): bigmath
(open-r1/Big-Math-RL-Verified-Processed, config level_3_4_5), bigmath-hard (config level_4_5) and
dapo-math (open-r1/DAPO-Math-17k-Processed, config en). These are read in their hub schema (`prompt`
is the problem, `solution` the short answer; DAPO's `prompt` wraps the problem in its "Answer:"
instruction, which we remove) and filtered as the official code does (prompts over 1024 characters
dropped); they are graded as math (math-verify).
A named set is read from `<data_dir>/<name>/<split>.jsonl`, where data_dir defaults to $QERL_DATA, else
~/.cache/qerl/data. If that file is missing we download it from the
Hugging Face Hub with `huggingface_hub` (the file for the split is found by listing the repo) and cache
it there; offline (no network, or HF_HUB_OFFLINE=1) that fails with an error naming the path to put the
file at. Hub sources: openai/gsm8k (config "main", parquet: needs pyarrow), HuggingFaceH4/MATH-500,
HuggingFaceH4/aime_2024, math-ai/amc23.
Any `PATH.jsonl` also works: one JSON object a line with the question in `question` (or `problem`, or a
string `prompt`) and the gold in `answer`, or only a `solution` whose `#### N` or last `\\boxed{}` is
the gold. A `kind` field sets the grading; without it an answer written `... #### N` is gsm8k and
anything else math. Blank lines are skipped; malformed lines are reported all at once, as
`path:line: reason`.
"""

import argparse
import json
import multiprocessing
import os
import re
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path

KINDS = ("gsm8k", "math")
MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The official QeRL system prompt (utils/data.py for BigMath, eval/gsm8k.py), without its source
# indentation: reasoning in <think> tags, the answer in <answer> tags.
OFFICIAL_SYSTEM_PROMPT = (
    "Solve the following math problem step by step. The reasoning process and direct answer are enclosed "
    "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think> <answer> answer here </answer>: \n<think>\n...\n</think>\n<answer>\n...\n</answer>")
PROMPT_STYLES = ("ours", "official")
DEFAULT_TIMEOUT = 5  # seconds for each math-verify parse / comparison (signal.alarm takes whole seconds)

# ---------------------------------------------------------------------------------------------------
# Reading answers out of text
# ---------------------------------------------------------------------------------------------------

# A plain number: optional sign, digits with optional thousands commas, optional decimals. The sign
# only counts when the '-' does not follow a word character or a closing bracket ("10-3" is 10 and 3);
# digits glued to a letter or a '.' on their left ("x2", "v1.2") are not numbers.
_NUM = r"(?:(?<![\w)\]}.])-)?(?<![\w.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUM)
# In the explicit answer spots a fraction is one value: \frac{3}{4}, \dfrac{3}{4}, -\frac{3}{4}, 3/4.
_VALUE_RE = re.compile(rf"(-?)\\[dt]?frac\{{\s*({_NUM})\s*\}}\{{\s*({_NUM})\s*\}}"
                       rf"|({_NUM})\s*/\s*({_NUM})|({_NUM})")
_HASH_RE = re.compile(r"####([^\n]*)")
_ANSWER_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# The official "soft format" check: reasoning in think tags, then the answer in answer tags.
_THINK_ANSWER_RE = re.compile(r"<think>.*?</think>\s*<answer>.*?</answer>", re.DOTALL)


def _to_fraction(text):
    try:
        return Fraction(Decimal(text.replace(",", "")))
    except (InvalidOperation, ValueError):
        return None


def _clean_numeric(text):
    """Undo the ways a number gets dressed up in text and LaTeX, keeping its digits and sign."""
    text = text.replace("\u2212", "-").replace("{,}", ",")  # Unicode minus; LaTeX's 1{,}000
    text = re.sub(r"(?<=\d)\\[,!;: ](?=\d{3})", "", text)  # 1\,000 (a thin space as thousands separator)
    text = re.sub(r"-\s*\\?\$\s*(?=\d)", "-", text)  # -$5 is -5
    return text.replace("\\$", " ").replace("$", " ").replace("\\%", " ").replace("\\!", "")


def _values(text):
    """All numeric values (Fractions) in `text`, in order, with fractions read as one value."""
    out = []
    for m in _VALUE_RE.finditer(_clean_numeric(text)):
        sign, fn, fd, sn, sd, plain = m.groups()
        if plain is not None:
            v = _to_fraction(plain)
        else:
            n, d = (fn, fd) if fn is not None else (sn, sd)
            n, d = _to_fraction(n), _to_fraction(d)
            v = None if n is None or not d else n / d * (-1 if sign else 1)
        if v is not None:
            out.append(v)
    return out


def _last_plain_number(text):
    nums = [_to_fraction(m.group()) for m in _NUMBER_RE.finditer(_clean_numeric(text))]
    nums = [v for v in nums if v is not None]
    return nums[-1] if nums else None


def extract_boxed(text):
    """Content of the LAST `\\boxed{...}` or `\\fbox{...}` in text (nested braces matched), or None when
    there is none or its braces never close (a completion cut off mid-answer)."""
    starts = list(re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text))
    if not starts:
        return None
    i = starts[-1].end()
    while i < len(text) and text[i] == " ":
        i += 1
    if i < len(text) and text[i] != "{":  # `\boxed 5`: the argument is one token
        return re.match(r"[^\s$]*", text[i:]).group() or None
    depth, j = 0, i
    while j < len(text):
        c = text[j]
        if c == "\\":  # \{ and \} are literal braces, not grouping; \\ is a line break
            j += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
        j += 1
    return None


def extract_answer_tag(text):
    """Content of the LAST closed `<answer>...</answer>` in text (stripped), or None."""
    tags = _ANSWER_TAG_RE.findall(text)
    return tags[-1].strip() if tags else None


def _gsm8k_value(text, strict=False):
    """The number a completion gives as its answer: `#### N`, else the last `<answer>` tag; lenient
    (strict=False) then falls back to the last \\boxed{}, else the last number anywhere."""
    for seg in reversed(_HASH_RE.findall(text)):
        vals = _values(seg)
        if vals:
            return vals[0]
    tag = extract_answer_tag(text)
    if tag is not None:
        vals = _values(tag)
        if vals:
            return vals[0]
    if strict:
        return None
    boxed = extract_boxed(text)
    if boxed is not None:
        vals = _values(boxed)
        if vals:
            return vals[-1]
    return _last_plain_number(text)


def _gsm8k_gold(gold):
    """A GSM8K gold (`... #### N`, or the bare number, str or number) as a Fraction."""
    text = str(gold)
    if "####" in text:
        text = text.rsplit("####", 1)[1]
    vals = _values(text)
    if not vals:
        raise ValueError(f"gsm8k gold answer has no number: {gold!r}")
    return vals[0]


def _fmt(v):
    """A Fraction as answer text: `18`, `0.25` when the decimal terminates, else `1/3`."""
    if v.denominator == 1:
        return str(v.numerator)
    d = v.denominator
    for p in (2, 5):
        while d % p == 0:
            d //= p
    if d == 1:
        return format(Decimal(v.numerator) / Decimal(v.denominator), "f")
    return f"{v.numerator}/{v.denominator}"


def _math_pred(text):
    """A math completion's answer: its last \\boxed{} content, else its last `<answer>` tag's (a box inside
    the tag was found first). Non-empty or None."""
    pred = extract_boxed(text)
    if pred is None:
        pred = extract_answer_tag(text)
    return pred if pred is not None and pred.strip() else None


def extract_answer(kind, completion, strict=False):
    """The final answer a completion gives, as text (gsm8k: the number, canonical; math: the last box
    content, else the answer tag's), or None when it gives none (see grade for strict)."""
    _check_kind(kind)
    if kind == "gsm8k":
        v = _gsm8k_value(completion, strict)
        return None if v is None else _fmt(v)
    return _math_pred(completion)


def has_final_answer(kind, completion):
    """Whether the completion states a final answer in an explicit answer spot: a `#### N` line or an
    `<answer>` tag holding a number (gsm8k), a closed non-empty `\\boxed{}` or `<answer>` tag (math)."""
    _check_kind(kind)
    if kind == "gsm8k":
        return _gsm8k_value(completion, strict=True) is not None
    return _math_pred(completion) is not None


def think_answer_format(completion):
    """The official format check: `<think>...</think>` followed by `<answer>...</answer>`, anywhere."""
    return _THINK_ANSWER_RE.search(completion) is not None


# ---------------------------------------------------------------------------------------------------
# LaTeX answers: normalization and math-verify
# ---------------------------------------------------------------------------------------------------

def _strip_wrappers(s, commands=("text", "textbf", "textrm", "mathrm", "mbox", "mathbf")):
    """`\\text{abc}` -> `abc` for the given commands, braces matched (contents may nest)."""
    pat = re.compile(r"\\(?:%s)\s*\{" % "|".join(commands))
    while True:
        m = pat.search(s)
        if not m:
            return s
        depth, j = 1, m.end()
        while j < len(s) and depth:
            depth += {"{": 1, "}": -1}.get(s[j], 0)
            j += 1
        if depth:  # unbalanced: leave the rest alone
            return s[:m.start()] + s[m.end():]
        s = s[:m.start()] + s[m.end():j - 1] + s[j:]


def normalize_latex(s):
    """A light canonical form of a LaTeX answer for string comparison: only rewrites that never change
    which value is meant (or that math-verify would equate anyway, like units, degrees and percent)."""
    s = str(s).strip()
    s = re.sub(r"(?<!\\)\$", "", s)  # math delimiters, not \$
    s = s.replace("\\$", "")
    s = re.sub(r"\\(?:left|right|big|Big|bigg|Bigg)(?![A-Za-z])", "", s)
    s = re.sub(r"\\[dt]frac(?![A-Za-z])", r"\\frac", s).replace("\\dbinom", "\\binom")
    s = re.sub(r"\^\s*\{?\s*\\circ\s*\}?", "", s).replace("\\degree", "").replace("°", "")
    s = s.replace("\\%", "").replace("%", "")
    s = _strip_wrappers(s)
    s = re.sub(r"\\[,;:! ]", "", s).replace("~", "")
    s = s.replace("{,}", ",")
    s = re.sub(r"\s+", "", s)
    return s.rstrip(".")


def _as_latex(s):
    # math-verify looks for LaTeX inside math delimiters; drop any unescaped ones already there.
    return "$" + re.sub(r"(?<!\\)\$", "", s) + "$"


def _math_verify(gold, pred, timeout):
    """math-verify's judgement of two bare LaTeX answers. With a timeout it uses signal.alarm, so main
    thread only; timeout=None runs unbounded anywhere."""
    from math_verify import parse, verify
    g = parse(_as_latex(gold), parsing_timeout=timeout)
    if not g:
        return False
    p = parse(_as_latex(pred), parsing_timeout=timeout)
    if not p:
        return False
    return bool(verify(g, p, timeout_seconds=timeout))


def _worker_main(conn):
    """Child-process loop serving math-verify to threads of the parent; its main thread owns SIGALRM."""
    import math_verify  # noqa: F401  (pay the import before saying ready)
    conn.send("ready")
    while True:
        try:
            gold, pred, timeout = conn.recv()
        except (EOFError, OSError):
            return
        try:
            ok = _math_verify(gold, pred, timeout)
        except Exception:  # a grading error is a wrong answer, never a dead worker
            ok = False
        conn.send(ok)


class _VerifyWorker:
    """One spawned child process running math-verify; a stuck child is killed and respawned."""

    START_S = 120  # spawning imports sympy: seconds on a loaded machine

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = self._conn = None

    def _start(self):
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA/threads
        parent, child = ctx.Pipe()
        self._proc = ctx.Process(target=_worker_main, args=(child,), daemon=True, name="tasks-math-verify")
        self._proc.start()
        child.close()
        self._conn = parent
        if not parent.poll(self.START_S):
            self._stop()
            raise RuntimeError("math-verify worker process did not start")
        parent.recv()

    def _stop(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.join()
            self._conn.close()
        self._proc = self._conn = None

    @property
    def pid(self):
        return None if self._proc is None else self._proc.pid

    def run(self, gold, pred, timeout, wait=None):
        """math-verify(gold, pred) in the child; False if it gives no answer within `wait` seconds
        (default: room for its two parses and several comparisons, each bounded by `timeout`)."""
        wait = 6 * timeout + 10 if wait is None else wait
        with self._lock:
            if self._proc is None or not self._proc.is_alive():
                try:
                    self._start()
                except (AssertionError, OSError, RuntimeError):
                    # No child possible (e.g. we are a daemonic process): grade here, without a timeout.
                    return _math_verify(gold, pred, None)
            try:
                self._conn.send((gold, pred, timeout))
                if self._conn.poll(wait):
                    return bool(self._conn.recv())
            except (EOFError, OSError):
                pass
            self._stop()
            return False


_WORKER = _VerifyWorker()


def math_equal(gold, pred, timeout=DEFAULT_TIMEOUT):
    """Whether two bare LaTeX answers are the same: normalized strings, else math-verify (safe on any
    thread, each step bounded by `timeout` seconds)."""
    timeout = max(1, int(timeout))
    if normalize_latex(gold) == normalize_latex(pred) != "":
        return True
    if threading.current_thread() is threading.main_thread():
        return _math_verify(gold, pred, timeout)
    return _WORKER.run(gold, pred, timeout)


# ---------------------------------------------------------------------------------------------------
# Grading and reward
# ---------------------------------------------------------------------------------------------------

def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}; kinds are {KINDS}")


def grade(kind, completion, gold, timeout=DEFAULT_TIMEOUT, *, strict=False):
    """True when `completion` (free model text) gives the `gold` answer. kind "gsm8k": gold is a dataset
    answer with `#### N` or the bare number; kind "math": gold is a LaTeX answer (see module doc).
    strict: the answer counts only in an explicit answer spot (gsm8k: `#### N` or `<answer>`; the
    lenient default also reads the last box, else the last number anywhere). Math is always strict."""
    _check_kind(kind)
    if kind == "gsm8k":
        v = _gsm8k_value(completion, strict)
        return v is not None and v == _gsm8k_gold(gold)
    pred = _math_pred(completion)
    if pred is None:
        return False
    gold = str(gold)
    gold_box = extract_boxed(gold)
    return math_equal(gold if gold_box is None else gold_box, pred, timeout)


def reward(kind, completion, gold, *, strict=False, signed=False, format_weight=0.0, prompt="ours"):
    """(total, parts): correctness 1/0 (signed: +1/-1, as DAPO), graded strict or lenient (see grade),
    plus format_weight if the completion has the prompted form: an explicit final answer (prompt "ours":
    has_final_answer) or think-then-answer tags (prompt "official": think_answer_format, the official
    soft format reward). parts = {"correct", "format"} sum to total."""
    if prompt not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {prompt!r}; styles are {PROMPT_STYLES}")
    ok = grade(kind, completion, gold, strict=strict)
    correct = (1.0 if ok else -1.0) if signed else float(ok)
    shaped = think_answer_format(completion) if prompt == "official" else has_final_answer(kind, completion)
    fmt = float(format_weight) * float(shaped)
    return correct + fmt, {"correct": correct, "format": fmt}


@dataclass(frozen=True)
class Task:
    """A kind of problem: how to ask it, how to read the answer, how to judge it. prompt "ours": the
    instruction follows the question in one user message; "official": the official system prompt, then
    the bare question."""
    kind: str
    instruction: str
    prompt: str = "ours"

    def messages(self, question):
        if self.prompt == "official":
            return [{"role": "system", "content": OFFICIAL_SYSTEM_PROMPT},
                    {"role": "user", "content": question.strip()}]
        return [{"role": "user", "content": f"{question.strip()}\n{self.instruction}"}]

    def build_prompt(self, tokenizer, question):
        """The prompt text for a chat model: the question and instruction in its chat template, ending
        with the assistant header so generation starts the answer."""
        return tokenizer.apply_chat_template(self.messages(question), add_generation_prompt=True,
                                             tokenize=False)

    def prompt_ids(self, tokenizer, question):
        """build_prompt's token ids: the template already holds every special token."""
        return tokenizer(self.build_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]

    def extract(self, completion, strict=False):
        return extract_answer(self.kind, completion, strict)

    def grade(self, completion, gold, strict=False):
        return grade(self.kind, completion, gold, strict=strict)

    def reward(self, completion, gold, **kw):
        return reward(self.kind, completion, gold, prompt=self.prompt, **kw)


TASKS = {"gsm8k": Task("gsm8k", GSM8K_INSTRUCTION), "math": Task("math", MATH_INSTRUCTION)}


def get_task(kind, prompt="ours"):
    """The Task of a kind, asked with our instruction (prompt "ours") or the official system prompt."""
    _check_kind(kind)
    if prompt not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {prompt!r}; styles are {PROMPT_STYLES}")
    return TASKS[kind] if prompt == "ours" else Task(kind, TASKS[kind].instruction, prompt)


# ---------------------------------------------------------------------------------------------------
# Datasets
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class HubSource:
    repo_id: str
    splits: dict  # our split name -> the hub's split name
    config: str = ""  # folder of the repo holding this config's files ("" = the whole repo)
    prepare: object = None  # raw hub row -> a row with question/answer fields, or None to drop it


# The wrapper DAPO-Math-17k puts around each problem (its "Answer: X" last-line format); we strip it so
# the problem is asked like every other math problem (\boxed{}), graded by one judge.
_DAPO_HEAD = ("Solve the following math problem step by step. The last line of your response should be of "
              "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
_DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'
MAX_PROMPT_CHARS = 1024  # the official length filter on BigMath / DAPO-Math prompts, in characters


def _bigmath_row(row):
    """open-r1/Big-Math-RL-Verified-Processed: `prompt` is the problem, `solution` the short answer
    (LaTeX, checked parseable by math-verify when the set was built); `source`, `domain`,
    `llama8b_solve_rate` describe it. Problems over MAX_PROMPT_CHARS are dropped, as officially."""
    if not isinstance(row.get("prompt"), str) or len(row["prompt"]) > MAX_PROMPT_CHARS:
        return None
    out = {"question": row["prompt"], "answer": row.get("solution")}
    if row.get("source") is not None:
        out["subject"] = row["source"]
    return out


def _dapo_row(row):
    """open-r1/DAPO-Math-17k-Processed: `prompt` is the user message of `source_prompt` (the problem in
    DAPO's wrapper), `solution` the integer answer (`reward_model.ground_truth`). The official filter
    (source_prompt's content over MAX_PROMPT_CHARS) runs on the wrapped text; the wrapper is then removed."""
    text = row.get("prompt")
    src = row.get("source_prompt")
    if isinstance(src, list) and src and isinstance(src[0], dict):
        text = src[0].get("content", text)
    if not isinstance(text, str) or len(text) > MAX_PROMPT_CHARS:
        return None
    question = text.removeprefix(_DAPO_HEAD).removesuffix(_DAPO_TAIL)
    out = {"question": question, "answer": row.get("solution")}
    info = row.get("extra_info")
    if isinstance(info, dict) and info.get("index") is not None:
        out["id"] = info["index"]
    return out


# name -> (grading kind, where to get it). arith is generated by arith.py, not downloaded. The paper's
# training sets (bigmath, bigmath-hard, dapo-math) have only a train split.
_BIGMATH = "open-r1/Big-Math-RL-Verified-Processed"
DATASETS = {
    "gsm8k": ("gsm8k", HubSource("openai/gsm8k", {"train": "train", "test": "test"}, config="main")),
    "math500": ("math", HubSource("HuggingFaceH4/MATH-500", {"test": "test"})),
    "aime24": ("math", HubSource("HuggingFaceH4/aime_2024", {"test": "train"})),
    "amc23": ("math", HubSource("math-ai/amc23", {"test": "test"})),
    "bigmath": ("math", HubSource(_BIGMATH, {"train": "train"}, config="level_3_4_5", prepare=_bigmath_row)),
    "bigmath-hard": ("math", HubSource(_BIGMATH, {"train": "train"}, config="level_4_5", prepare=_bigmath_row)),
    "dapo-math": ("math", HubSource("open-r1/DAPO-Math-17k-Processed", {"train": "train"}, config="en",
                                    prepare=_dapo_row)),
    "arith": ("gsm8k", None),
}


def default_data_dir():
    return Path(os.environ.get("QERL_DATA") or Path.home() / ".cache" / "qerl" / "data")


def dataset_path(name, split="test", data_dir=None):
    """Where the named dataset's split is read from (and cached to)."""
    return Path(data_dir if data_dir is not None else default_data_dir()) / name / f"{split}.jsonl"


def _answer_text(v):
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, float) and v.is_integer():
        return str(int(v))  # amc23 stores 27.0
    return str(v).strip()


def _normalize(row, kind):
    """A raw row as a record, or a str saying what is wrong with it."""
    if not isinstance(row, dict):
        return f"expected a JSON object, got {type(row).__name__}"
    question = next((row[k] for k in ("question", "problem", "prompt")
                     if isinstance(row.get(k), str) and row[k].strip()), None)
    if question is None:
        return "no question: needs a non-empty 'question' (or 'problem', or a string 'prompt') field"
    solution = row.get("solution") if isinstance(row.get("solution"), str) else None
    answer = row.get("answer")
    if answer is None and solution:
        answer = solution if "####" in solution else extract_boxed(solution)
    if answer is None or _answer_text(answer) == "":
        return "no answer: needs an 'answer' field, or a 'solution' with '#### N' or a \\boxed{} answer"
    answer = _answer_text(answer)
    hashed = "####" in answer
    if hashed:
        solution = solution or answer
        answer = answer.rsplit("####", 1)[1].strip()
    kind = row.get("kind") or kind or ("gsm8k" if hashed else "math")
    if kind not in KINDS:
        return f"unknown kind {kind!r}; kinds are {KINDS}"
    rec = {"question": question, "answer": answer, "kind": kind}
    if solution:
        rec["solution"] = solution
    rid = row.get("id", row.get("unique_id"))
    if rid is not None:
        rec["id"] = rid
    for k in ("level", "subject"):
        if row.get(k) is not None:
            rec[k] = row[k]
    return rec


def read_jsonl(path, kind=None, limit=None, prepare=None):
    """Records from a jsonl file (see module doc for the fields). `prepare` maps each raw row first (a
    hub set's own schema; None from it drops the row); `limit` keeps the first N (None: all). Raises
    ValueError listing every malformed line as `path:line: reason`."""
    _check_limit(limit)
    path = Path(path)
    records, errors = [], []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                if prepare is not None and isinstance(row, dict):
                    row = prepare(row)
                    if row is None:
                        continue
                rec = _normalize(row, kind)
            except json.JSONDecodeError as e:
                rec = f"invalid JSON ({e.msg} at column {e.colno})"
            if isinstance(rec, str):
                errors.append(f"{path}:{lineno}: {rec}")
            else:
                records.append(rec)
    if errors:
        shown = "\n  ".join(errors[:20]) + (f"\n  ... and {len(errors) - 20} more" if len(errors) > 20 else "")
        raise ValueError(f"{len(errors)} malformed line(s) in {path}:\n  {shown}")
    return records[:limit] if limit is not None else records


def _hub_offline():
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def _pick_files(files, source, hub_split):
    """The repo files holding `hub_split`: `<split>.jsonl`, `<split>-00000-of-00001.parquet`,
    `.../<split>/0000.parquet` and the like, jsonl preferred over json over parquet."""
    prefix = source.config + "/" if source.config else ""
    for ext in (".jsonl", ".json", ".parquet"):
        hits = sorted(f for f in files if f.startswith(prefix) and f.endswith(ext)
                      and (Path(f).name.startswith(hub_split + ".") or Path(f).name.startswith(hub_split + "-")
                           or Path(f).parent.name == hub_split))
        if hits:
            return hits
    raise FileNotFoundError(f"no file for split {hub_split!r} in {source.repo_id} among {files}")


def _read_rows(local):
    if local.endswith(".parquet"):
        try:
            import pyarrow.parquet as pq
        except ImportError as e:
            raise ImportError(f"{local} is parquet: `pip install pyarrow` to read it") from e
        return pq.read_table(local).to_pylist()
    text = Path(local).read_text(encoding="utf-8")
    if local.endswith(".json"):
        try:
            data = json.loads(text)
            return data if isinstance(data, list) else data.get("data", data.get("rows", []))
        except json.JSONDecodeError:
            pass  # `datasets.to_json` writes JSON lines under a .json name
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _fetch(source, hub_split):
    """Raw rows of one split from the Hugging Face Hub."""
    from huggingface_hub import HfApi, hf_hub_download
    files = HfApi().list_repo_files(source.repo_id, repo_type="dataset")
    rows = []
    for f in _pick_files(files, source, hub_split):
        rows += _read_rows(hf_hub_download(source.repo_id, f, repo_type="dataset"))
    return rows


def _download(name, source, split, path):
    if _hub_offline():
        reason = "offline (HF_HUB_OFFLINE is set)"
    else:
        try:
            rows = _fetch(source, source.splits[split])
        except Exception as e:  # no network, missing pyarrow, repo moved: all end the same way
            reason = f"download from the Hugging Face Hub ({source.repo_id}) failed: {type(e).__name__}: {e}"
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".jsonl.tmp")
            with open(tmp, "w", encoding="utf-8") as f:
                for row in rows:
                    f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            os.replace(tmp, path)
            return
    if source.prepare is not None:  # a hub set in its own schema: get the hub's rows as they are
        how = (f"On a machine with network run `python tasks.py --data {name} --split {split}` (it downloads "
               f"{source.repo_id}, config {source.config!r}, split {source.splits[split]!r}, and caches the raw "
               f"rows as jsonl under its $QERL_DATA or ~/.cache/qerl/data) and copy {name}/{split}.jsonl "
               f"from there to {path}; or write the rows of that split's parquet files to {path}, one "
               f"JSON object a line in the hub's own fields")
    else:
        how = "Put the split there as jsonl (one object a line with 'question' or 'problem', and 'answer')"
    raise FileNotFoundError(
        f"dataset {name!r} split {split!r}: no local file at {path} and {reason}.\n"
        f"{how}, or set QERL_DATA / pass data_dir to the folder holding {name}/{split}.jsonl, "
        f"or pass the path of a .jsonl file instead of the name.")


def _check_limit(limit):
    # A negative limit would slice from the end (records[:-1] drops the last one): refuse it.
    if limit is not None and not (isinstance(limit, int) and limit >= 0):
        raise ValueError(f"limit must be a whole number >= 0 (how many records to keep from the start) or None "
                         f"for all, got {limit!r}")


def load_dataset(name_or_path, split="test", limit=None, data_dir=None):
    """Records {question, answer, kind, [solution, id, level, subject]} of a named dataset's split or
    of a jsonl file (see module doc). `limit` keeps the first N (None: all; ValueError below 0)."""
    _check_limit(limit)
    name = str(name_or_path)
    if name in DATASETS:
        kind, source = DATASETS[name]
        if source is None:  # arith: generated, deterministic, nothing to cache
            import arith
            rows = arith.load(split, n=limit)
            return [_normalize(r, kind) for r in rows]
        if split not in source.splits:
            raise ValueError(f"dataset {name!r} has splits {sorted(source.splits)}, not {split!r}")
        path = dataset_path(name, split, data_dir)
        if not path.exists():
            _download(name, source, split, path)
        return read_jsonl(path, kind=kind, limit=limit, prepare=source.prepare)
    path = Path(name).expanduser()
    if path.is_file():
        return read_jsonl(path, limit=limit)
    raise FileNotFoundError(f"{name!r} is neither a dataset name ({', '.join(DATASETS)}) nor a file")


def main():
    parser = argparse.ArgumentParser(description="Load (downloading and caching if needed) a dataset "
                                                 "and show one prompt with its gold answer.")
    parser.add_argument("--data", default="gsm8k",
                        help="dataset name (" + ", ".join(DATASETS) + ") or a .jsonl path")
    parser.add_argument("--split", default="test", help="split of a named dataset")
    parser.add_argument("--limit", type=int, default=None, help="keep only the first N items (N >= 1)")
    parser.add_argument("--data-dir", default=None,
                        help="cache folder (default $QERL_DATA or ~/.cache/qerl/data)")
    args = parser.parse_args()
    if args.limit is not None and args.limit < 1:
        parser.error(f"--limit {args.limit}: must be >= 1 (or leave it out for every item)")
    try:
        items = load_dataset(args.data, args.split, args.limit, args.data_dir)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"error: {e}")
    kinds = sorted({it["kind"] for it in items})
    print(f"{args.data}/{args.split}: {len(items)} items, kind {', '.join(kinds)}")
    if items:
        it = items[0]
        print(get_task(it["kind"]).messages(it["question"])[0]["content"])
        print("gold:", it["answer"])


if __name__ == "__main__":
    main()
