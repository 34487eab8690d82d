"""Tasks: how a math problem is asked, how its answer is read out of free text, how that answer is
judged, and what RL pays for it. The text side of RL with verifiable rewards; it imports no model code,
and the problem sets themselves are data.py's.

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
math-verify bounds each parse and comparison with `signal.alarm` (the `timeout` of grade), and signals
work only on the main thread, where train.py and eval.py grade. From another thread pass timeout=None
(math-verify then runs unbounded); with a timeout, grading math there is refused with a ValueError.

Prompts (PROMPTS, get_task)
---------------------------
A Task is a kind asked in one prompt style: an optional system message, then the question with the
style's instruction (if any) after it in one user message (every chat template has a user role; not all
have a system role), rendered with the tokenizer's chat template and the assistant header
(`add_generation_prompt=True`). The styles (PROMPT_STYLES):
- ours: math: "Please reason step by step, and put your final answer within \\boxed{}." (the paper's
  setup for MATH-style data; also Qwen2.5-Math's and DeepSeek-R1's evaluation prompt); gsm8k: step by
  step, the final answer after `####` (GSM8K's own solution format).
- paper: as the code of the paper's time asks (NVlabs/QeRL 1bf4803, utils/data.py): gsm8k: the question,
  then an instruction asking for the reasoning in `<think> </think>` and the answer after `####`
  (PAPER_GSM8K_INSTRUCTION); math: the official system prompt, as "official".
- official: the official system prompt (OFFICIAL_SYSTEM_PROMPT: reasoning in `<think> </think>`, the
  answer in `<answer> </answer>`) and the bare question: how the official code asks BigMath problems
  (at both commits) and how its GSM8K eval asks (eval/gsm8k.py).
- bare: the question alone: how HEAD (e8c6e79, utils/data.py) trains on GSM8K. Its system prompt is
  commented out there, so the tags its reward pays for are never asked for.
The synthetic arith task (arith.py) is graded and prompted as gsm8k. The countdown kind (countdown.py, the
search task of the AQN replication) is asked with the one instruction its policy was taught and graded by
countdown.grade, strictly; the official variants' rewards are for GSM8K and BigMath and refuse it.

Rewards (REWARDS, reward)
-------------------------
`reward(kind, completion, gold, variant, *, signed=False, format_weight=None, prompt=None)` returns
(total, parts) with parts = {"correct": ..., "format": ...} summing to total. The variants, for gsm8k:

  variant   correct part                                format part                        asked with
  paper     1.0 if the number after the last `#### `    0.2 for a closed `<think>` block   paper
            equals the gold string                      with something in it
  official  2.0 if the text in the last `<answer>`      0.2 for `<think>...</think>` then  bare
            tag equals the gold string                  `<answer>...</answer>`
  strict    1 (signed: +1 / -1, the DAPO recipe's) if   format_weight (default 0) if the   ours
            grade(strict=True): `#### N` or `<answer>`  answer is in the form its prompt
  lenient   the same with grade's lenient reader        asks (asked_form)                  ours

paper is NVlabs/QeRL at 1bf4803, the first release and the code of the paper's time: qerl.py pairs
GSM8K with utils/rewards.py's gsm8k_score (strict `#### N`, 1.0) and think_reward_func (0.2), and
utils/data.py asks with the think/`####` instruction. official is HEAD, e8c6e79: qerl.py pairs GSM8K with
correctness_reward_func (2.0) and soft_format_reward_func (0.2), utils/data.py asks the bare question.
TRL adds the reward functions' outputs (reward_weights default to 1). Which produced the paper's
numbers: `paper`. 1bf4803 is the first commit, published with the paper, and its scripts are the
recipe the paper describes; HEAD's reward and prompt came six weeks later, in two commits that change
nothing else (`Update data.py`, `Update qerl.py`). So the paper's recipe defaults to `paper`, and
`official` is there to compare with what the repository trains today. The exact behaviour of each,
which the variants reproduce (tests/test_tasks.py, cases written from the official functions):
- paper reads `#### ` (one space), then a run of digits, `.` and `,` with an optional leading `-`; it
  takes the last such run, drops its commas and compares the string with the gold. So `#### 18.00`,
  `#### 18.` (the period is in the run), `####18` and `#### $18` are wrong, and a gold written with a
  thousands comma (79 of GSM8K's 7,473 training answers, e.g. `1,080`) can never be matched: such a
  problem pays only the format part. The think block needs at least one character between the tags.
- official takes the text after the last `<answer>` up to the next `</answer>` (to the end when the tag
  is not closed; the whole completion when there is none), stripped, and compares it with the gold
  string: `18.0`, `$18` and `18 apples` are wrong; a completion that is just `18` is right. Its format
  check allows empty tags and anything around them.
- For kind "math" (BigMath) both are the same: the BigMath reward did not change between the commits.
  1.0 from math-verify (accuracy_reward: the whole completion parsed with boxed answers tried first and
  no unanchored fallback, try_extract_without_anchor=False) plus 0.2 for think-then-answer tags
  (soft_format_reward_func), asked with the official system prompt. Here the correct part is `grade`
  (the last box, else the last `<answer>` tag, judged as above): the same judge, a narrower reader (an
  answer stated only after "the final answer is", with no box or tag, is wrong here), and a gold that
  math-verify cannot parse grades 0 where the official reward returns None (TRL skips it).
- DAPO-Math's official reward (dapo_score: 1.0 for DAPO's last-line `Answer: X`, no format part) is not
  a variant: we ask and grade DAPO-Math as every math problem.
strict and lenient are ours: the value, not the string (`18.00`, `$18` and `1,080` are right), the
answer in the spot our prompt asks for (strict) or anywhere (lenient), and a format weight chosen per
run. Advantages divide by the group's reward std, so only the ratio of the format part to the correct
part matters: paper 0.2 : 1, official 0.2 : 2.

What the reported numbers measure (results/recipe.md): trained models' GSM8K through the official eval
script (the official prompt, the answer read from the tags: strict, but see eval.py for its
first-character comparison); base models' GSM8K through lm-eval, which prints both its strict `#### N`
match and its flexible last-number match; MATH500 / AIME / AMC through lighteval's math-verify, which
reads the final answer wherever the completion states it (lenient about format). eval.py reports both of
ours side by side.
"""

import math
import re
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from fractions import Fraction

import countdown

KINDS = ("gsm8k", "math", "countdown")
DEFAULT_TIMEOUT = 5  # seconds for each math-verify parse / comparison (signal.alarm takes whole seconds)

MATH_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
# The official QeRL system prompt (utils/data.py for BigMath, eval/gsm8k.py), without its source
# indentation: reasoning in <think> tags, the answer in <answer> tags.
OFFICIAL_SYSTEM_PROMPT = (
    "Solve the following math problem step by step. The reasoning process and direct answer are enclosed "
    "within <think> </think> and <answer> </answer> tags, respectively, i.e., <think> reasoning process here "
    "</think> <answer> answer here </answer>: \n<think>\n...\n</think>\n<answer>\n...\n</answer>")
# The instruction after each GSM8K question at NVlabs/QeRL 1bf4803 (utils/data.py), without its source
# indentation. The `#     ` that opens its last four lines is in the text the model sees (it sits inside
# the string literal, where it reads like a comment), so it is kept: the policy must see what the paper's
# policy saw.
PAPER_GSM8K_INSTRUCTION = (
    "Let's think step by step first within <think> </think> tags, and output the final answer after \"####\" "
    "tag, i.e.,: \n#     <think>\n#     ...\n#     </think>\n#     #### number")
# style -> kind -> (system message, instruction after the question); "" is none.
PROMPTS = {  # (countdown.py's search task is asked one way: the instruction the policy was taught)
    "ours": {"gsm8k": ("", GSM8K_INSTRUCTION), "math": ("", MATH_INSTRUCTION), "countdown": ("", countdown.INSTRUCTION)},
    "paper": {"gsm8k": ("", PAPER_GSM8K_INSTRUCTION), "math": (OFFICIAL_SYSTEM_PROMPT, ""),
              "countdown": ("", countdown.INSTRUCTION)},
    "official": {"gsm8k": (OFFICIAL_SYSTEM_PROMPT, ""), "math": (OFFICIAL_SYSTEM_PROMPT, ""),
                 "countdown": ("", countdown.INSTRUCTION)},
    "bare": {"gsm8k": ("", ""), "math": ("", ""), "countdown": ("", "")},
}
PROMPT_STYLES = tuple(PROMPTS)

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
    if kind == "countdown":
        return countdown.extract(completion)
    if kind == "gsm8k":
        v = _gsm8k_value(completion, strict)
        return None if v is None else _fmt(v)
    return _math_pred(completion)


def has_final_answer(kind, completion):
    """Whether the completion states a final answer in an explicit answer spot: a `#### N` line or an
    `<answer>` tag holding a number (gsm8k), a closed non-empty `\\boxed{}` or `<answer>` tag (math)."""
    _check_kind(kind)
    if kind == "countdown":
        return countdown.has_answer(completion)
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


def math_equal(gold, pred, timeout=DEFAULT_TIMEOUT):
    """Whether two bare LaTeX answers are the same: normalized strings, else math-verify, each of its
    steps bounded by `timeout` seconds (main thread only), or unbounded with timeout=None (any thread)."""
    if normalize_latex(gold) == normalize_latex(pred) != "":
        return True
    if timeout is not None and threading.current_thread() is not threading.main_thread():
        raise ValueError("grading math off the main thread: math-verify bounds its time with signal.alarm, which "
                         "works only on the main thread; grade there, or pass timeout=None (no bound)")
    return _math_verify(gold, pred, None if timeout is None else max(1, int(timeout)))


# ---------------------------------------------------------------------------------------------------
# Grading
# ---------------------------------------------------------------------------------------------------

def _check_kind(kind):
    if kind not in KINDS:
        raise ValueError(f"unknown task kind {kind!r}; kinds are {KINDS}")


def grade(kind, completion, gold, timeout=DEFAULT_TIMEOUT, *, strict=False):
    """True when `completion` (free model text) gives the `gold` answer. kind "gsm8k": gold is a dataset
    answer with `#### N` or the bare number; kind "math": gold is a LaTeX answer (see module doc).
    strict: the answer counts only in an explicit answer spot (gsm8k: `#### N` or `<answer>`; the
    lenient default also reads the last box, else the last number anywhere). Math is always strict.
    timeout: seconds for each math-verify step (None: unbounded, for threads other than the main one)."""
    _check_kind(kind)
    if kind == "countdown":  # (an expression of the four numbers that reaches the target: always strict)
        return countdown.grade(completion, gold)
    if kind == "gsm8k":
        v = _gsm8k_value(completion, strict)
        return v is not None and v == _gsm8k_gold(gold)
    pred = _math_pred(completion)
    if pred is None:
        return False
    gold = str(gold)
    gold_box = extract_boxed(gold)
    return math_equal(gold if gold_box is None else gold_box, pred, timeout)


# ---------------------------------------------------------------------------------------------------
# Rewards: the official variants' readers, the table, the reward
# ---------------------------------------------------------------------------------------------------

_PAPER_HASH_RE = re.compile(r"#### (-?[0-9.,]+)")  # one space, then digits, points and commas
_THINK_BLOCK_RE = re.compile(r"<think>.+?</think>", re.DOTALL)


def paper_hash_answer(text):
    """The answer that the 1bf4803 GSM8K reward reads: the run of digits, `.` and `,` (optionally after a
    `-`) that follows the last `#### `, its commas dropped; None when there is none."""
    runs = _PAPER_HASH_RE.findall(text)
    return runs[-1].replace(",", "") if runs else None


def has_think_block(text):
    """The 1bf4803 GSM8K format check: `<think>`, at least one character, `</think>`, anywhere."""
    return _THINK_BLOCK_RE.search(text) is not None


def official_answer_text(text):
    """The answer that HEAD's GSM8K reward reads: the text after the last `<answer>` (the whole text when
    there is none) up to the next `</answer>` (to the end when there is none), stripped."""
    start = text.rfind("<answer>")
    body = text if start < 0 else text[start + len("<answer>"):]
    end = body.find("</answer>")
    return (body if end < 0 else body[:end]).strip()


def _gold_text(gold):
    """A GSM8K gold as the official code holds it: the string after `####`, stripped."""
    text = str(gold)
    return (text.rsplit("####", 1)[1] if "####" in text else text).strip()


def asked_form(kind, completion, prompt="ours"):
    """Whether the completion has the form that the `prompt` style asks a `kind` problem for, checked as
    that style's own reward checks it: ours, an answer in an explicit spot (has_final_answer); paper,
    the think block (gsm8k) or think-then-answer tags (math); official, think-then-answer tags. The bare
    prompt asks for no form: ValueError."""
    _check_kind(kind)
    if prompt == "ours":
        return has_final_answer(kind, completion)
    if prompt == "paper" and kind == "gsm8k":
        return has_think_block(completion)
    if prompt in ("paper", "official"):
        return think_answer_format(completion)
    raise ValueError(f"prompt style {prompt!r} asks for no answer form, so there is none to reward"
                     if prompt in PROMPT_STYLES else f"unknown prompt style {prompt!r}; styles are {PROMPT_STYLES}")


@dataclass(frozen=True)
class Reward:
    """A named reward: what it pays for a right answer and for the format (per kind), how it reads and
    judges the answer, what earns the format part, the prompt style it pairs with (per kind), its source."""
    correct: dict  # kind -> paid for a right answer
    format: dict  # kind -> paid for the format (strict / lenient: format_weight's default)
    grading: str
    form: str
    prompt: dict  # kind -> prompt style
    source: str


def _both(v):
    return {kind: v for kind in KINDS}


_MATH_OFFICIAL = "math: math-verify on the last box, else the last <answer> tag"
REWARDS = {
    "paper": Reward(
        _both(1.0), _both(0.2),
        "gsm8k: the number after the last '#### ' equals the gold string (paper_hash_answer); " + _MATH_OFFICIAL,
        "gsm8k: a closed <think> block with something in it; math: <think>...</think> then <answer>...</answer>",
        {"gsm8k": "paper", "math": "paper", "countdown": "ours"},
        "NVlabs/QeRL 1bf4803: qerl.py get_dataset; utils/rewards.py gsm8k_score + think_reward_func (GSM8K), "
        "accuracy_reward + soft_format_reward_func (BigMath); utils/data.py (prompts)"),
    "official": Reward(
        {"gsm8k": 2.0, "math": 1.0, "countdown": 1.0}, _both(0.2),
        "gsm8k: the text in the last <answer> tag equals the gold string (official_answer_text); " + _MATH_OFFICIAL,
        "<think>...</think> then <answer>...</answer> (think_answer_format)",
        {"gsm8k": "bare", "math": "official", "countdown": "ours"},
        "NVlabs/QeRL e8c6e79: qerl.py get_dataset; utils/rewards.py correctness_reward_func + "
        "soft_format_reward_func (GSM8K), accuracy_reward + soft_format_reward_func (BigMath); utils/data.py"),
    "strict": Reward(
        _both(1.0), _both(0.0), "grade(strict=True): the value in `#### N` or <answer> (gsm8k), math as grade",
        "the form the prompt asks for (asked_form)", _both("ours"), "ours"),
    "lenient": Reward(
        _both(1.0), _both(0.0), "grade(): also the last box, else the last number (gsm8k), math as grade",
        "the form the prompt asks for (asked_form)", _both("ours"), "ours"),
}
OURS = ("strict", "lenient")  # the variants whose sign and format weight a run chooses


def check_reward(variant, *, signed=False, format_weight=None, prompt=None):
    """ValueError, in one line saying what to do, for a reward that reward() would refuse: an unknown
    variant or prompt style, signed or a format weight with an official variant (its weights are its
    source's), a format weight that is negative or not finite, or one with a prompt that asks for no form."""
    if variant not in REWARDS:
        raise ValueError(f"unknown reward variant {variant!r}; variants are {', '.join(REWARDS)}")
    if prompt is not None and prompt not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {prompt!r}; styles are {PROMPT_STYLES}")
    if variant not in OURS:
        if signed or format_weight is not None:
            r = REWARDS[variant]
            raise ValueError(f"the {variant} reward pays as its source does ({r.correct['gsm8k']:g} right, "
                             f"{r.format['gsm8k']:g} format): signed and a format weight are for "
                             f"{' / '.join(OURS)}")
        return
    if format_weight is not None:
        if not (isinstance(format_weight, (int, float)) and math.isfinite(format_weight) and format_weight >= 0):
            raise ValueError(f"format weight {format_weight!r}: must be a finite number >= 0")
        if format_weight and prompt == "bare":
            raise ValueError("the bare prompt asks for no answer form: a format weight needs another prompt style "
                             "(or 0)")


def reward(kind, completion, gold, variant="lenient", *, signed=False, format_weight=None, prompt=None):
    """(total, parts) for one completion, parts = {"correct", "format"} summing to total (module doc).
    variant: a name of REWARDS. For strict / lenient: signed pays a wrong answer -1 (DAPO), format_weight
    (None: 0) is paid when the completion has the form that `prompt` (None: "ours") asks for (asked_form).
    paper / official pay their source's fixed weights whatever the prompt; signed or a weight is refused."""
    check_reward(variant, signed=signed, format_weight=format_weight, prompt=prompt)
    _check_kind(kind)
    r = REWARDS[variant]
    if variant in OURS:
        ok = grade(kind, completion, gold, strict=variant == "strict")
        correct = (1.0 if ok else -1.0) if signed else float(ok)
        weight = r.format[kind] if format_weight is None else float(format_weight)
        fmt = weight * float(asked_form(kind, completion, prompt or "ours")) if weight else 0.0
        return correct + fmt, {"correct": correct, "format": fmt}
    if kind == "countdown":
        raise ValueError(f"the {variant} reward is the official GSM8K / BigMath one; a countdown problem is graded "
                         f"by --reward strict")
    if kind == "math":  # the BigMath reward, the same at both commits
        ok, shaped = grade("math", completion, gold), think_answer_format(completion)
    elif variant == "paper":
        ok, shaped = paper_hash_answer(completion) == _gold_text(gold), has_think_block(completion)
    else:
        ok, shaped = official_answer_text(completion) == _gold_text(gold), think_answer_format(completion)
    correct, fmt = r.correct[kind] * float(ok), r.format[kind] * float(shaped)
    return correct + fmt, {"correct": correct, "format": fmt}


# ---------------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Task:
    """A kind of problem asked in one prompt style (PROMPTS): the system message, if any, then the question
    with the instruction, if any, after it in one user message."""
    kind: str
    instruction: str = ""
    system: str = ""
    prompt: str = "ours"

    def messages(self, question):
        user = question.strip() + (f"\n{self.instruction}" if self.instruction else "")
        return ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": user}]

    def build_prompt(self, tokenizer, question):
        """The prompt text for a chat model: the messages in its chat template, ending with the assistant
        header so generation starts the answer."""
        return tokenizer.apply_chat_template(self.messages(question), add_generation_prompt=True,
                                             tokenize=False)

    def prompt_ids(self, tokenizer, question):
        """build_prompt's token ids: the template already holds every special token."""
        return tokenizer(self.build_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]


def get_task(kind, prompt="ours"):
    """The Task of a kind asked in a prompt style (PROMPT_STYLES: ours, paper, official, bare)."""
    _check_kind(kind)
    if prompt not in PROMPT_STYLES:
        raise ValueError(f"unknown prompt style {prompt!r}; styles are {PROMPT_STYLES}")
    system, instruction = PROMPTS[prompt][kind]
    return Task(kind, instruction, system, prompt)
