"""The paper's reward and data: strict grading (the answer only in its prompted spot) next to the
lenient grader, the official format reward, the official prompt, eval's side-by-side accuracies, and
the paper's training sets (BigMath, DAPO-Math) read from the hub's own file layout, offline, from
hand-written fixture rows in the hub's schema (tests/fixtures/hub/)."""

import json
import random
from pathlib import Path

import pytest
import torch

import tasks

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "hub"


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
# Reward: total and parts; the official format reward; the official prompt
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("completion, strict, prompt, total, correct, fmt", [
    ("<think>6+12</think>\n<answer>18</answer>", True, "official", 1.1, 1.0, 0.1),
    ("<answer>18</answer>", True, "official", 1.0, 1.0, 0.0),  # official format needs the think tags too
    ("<answer>18</answer>", True, "ours", 1.1, 1.0, 0.1),  # ours: an explicit answer spot
    ("The total is 18.", True, "ours", 0.0, 0.0, 0.0),
    ("The total is 18.", False, "ours", 1.0, 1.0, 0.0),
    ("<think>x</think><answer>17</answer>", True, "official", 0.1, 0.0, 0.1),  # format paid alone
    ("#### 17", True, "ours", 0.1, 0.0, 0.1),
])
def test_reward_total_and_parts(completion, strict, prompt, total, correct, fmt):
    got, parts = tasks.reward("gsm8k", completion, "18", strict=strict, format_weight=0.1, prompt=prompt)
    assert parts == {"correct": correct, "format": pytest.approx(fmt)}
    assert got == pytest.approx(total) == pytest.approx(parts["correct"] + parts["format"])
    signed, sp = tasks.reward("gsm8k", completion, "18", strict=strict, signed=True, prompt=prompt)
    assert sp["correct"] == (1.0 if correct else -1.0) and sp["format"] == 0.0 and signed == sp["correct"]


def test_math_reward_strict_official_format():
    text = "<think>r = 2, so pi r^2</think>\n<answer>\\boxed{4\\pi}</answer>"
    total, parts = tasks.reward("math", text, "4\\pi", strict=True, format_weight=0.2, prompt="official")
    assert parts == {"correct": 1.0, "format": pytest.approx(0.2)} and total == pytest.approx(1.2)
    with pytest.raises(ValueError, match="prompt style"):
        tasks.reward("math", text, "4\\pi", prompt="paper")


def test_official_prompt_messages_and_task_methods():
    t = tasks.get_task("gsm8k", prompt="official")
    msgs = t.messages("  What is 2+2? ")
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[1]["content"] == "What is 2+2?"
    assert "<think> </think>" in msgs[0]["content"] and "<answer> </answer>" in msgs[0]["content"]
    assert tasks.get_task("gsm8k").messages("q")[0]["content"].endswith(tasks.GSM8K_INSTRUCTION)
    text = "<think>2+2</think><answer>4</answer>"
    assert t.reward(text, "4", strict=True, format_weight=0.5) == (1.5, {"correct": 1.0, "format": 0.5})
    assert tasks.get_task("gsm8k").reward("#### 4", "4", strict=True, format_weight=0.5)[0] == 1.5
    assert t.grade("4", "4") and not t.grade("4", "4", strict=True)
    with pytest.raises(ValueError, match="prompt style"):
        tasks.get_task("math", prompt="boxed")


# ------------------------------------------------------------------------------------------------
# eval: strict and lenient side by side
# ------------------------------------------------------------------------------------------------

def test_evaluate_reports_strict_next_to_lenient():
    import eval as ev
    import hub
    import model

    items = tasks.load_dataset("arith", "test", limit=12)
    m = model.Transformer.from_pretrained("tiny", dtype=torch.float32)
    res = ev.evaluate(m, hub.load_tokenizer("tiny"), items, samples=2, temperature=1.0, top_p=1.0,
                      max_new_tokens=48, seed=3)
    recs = res["records"]
    for r in recs:
        assert r["correct_strict"] == tasks.grade("gsm8k", r["completion"], r["gold"], strict=True)
        assert r["correct"] == tasks.grade("gsm8k", r["completion"], r["gold"])
        assert r["correct_strict"] <= r["correct"]
    assert res["accuracy"] == pytest.approx(sum(r["correct"] for r in recs) / len(recs))
    assert res["accuracy_strict"] == pytest.approx(sum(r["correct_strict"] for r in recs) / len(recs))
    assert res["answer_format"] == pytest.approx(sum(r["answer_format"] for r in recs) / len(recs))
    per_item = [sum(r["correct_strict"] for r in recs if r["index"] == i) for i in range(len(items))]
    assert res["pass@k_strict"][2] == pytest.approx(sum(c > 0 for c in per_item) / len(items))
    assert res["pass@1"] == res["accuracy"] and set(res["pass@k"]) == set(res["pass@k_strict"]) == {1, 2}


# ------------------------------------------------------------------------------------------------
# The paper's training sets, from the hub's file layout (offline fixtures)
# ------------------------------------------------------------------------------------------------

def fixture_rows(name):
    return [json.loads(line) for line in (FIXTURES / name).read_text().splitlines() if line.strip()]


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """A local stand-in for the Hugging Face Hub: repo id -> {file in the repo: rows}, written as the
    parquet files the hub serves; list_repo_files and hf_hub_download read them."""
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa
    import huggingface_hub

    repos, calls = {}, []

    def add(repo_id, files):
        for rel, rows in files.items():
            path = tmp_path / "hub" / repo_id / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.Table.from_pylist(rows), path)
        repos.setdefault(repo_id, []).extend(files)

    monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_files",
                        lambda self, repo_id, repo_type=None, **kw: ["README.md", *repos[repo_id]])

    def download(repo_id, filename, repo_type=None, **kw):
        calls.append((repo_id, filename))
        return str(tmp_path / "hub" / repo_id / filename)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    return add, calls


def test_bigmath_from_the_hub_layout(fake_hub, tmp_path):
    add, calls = fake_hub
    rows = fixture_rows("big_math_rl_verified_processed.jsonl")
    add("open-r1/Big-Math-RL-Verified-Processed", {
        "level_3_4_5/train-00000-of-00002.parquet": rows[:2], "level_3_4_5/train-00001-of-00002.parquet": rows[2:],
        "level_4_5/train-00000-of-00001.parquet": rows[1:2], "all/train-00000-of-00001.parquet": rows})
    items = tasks.load_dataset("bigmath", "train", data_dir=tmp_path / "cache")
    assert calls == [("open-r1/Big-Math-RL-Verified-Processed", f"level_3_4_5/train-0000{i}-of-00002.parquet")
                     for i in range(2)]
    kept = [r for r in rows if len(r["prompt"]) <= 1024]  # the official filter drops the long one
    assert len(kept) == 3 < len(rows)
    assert [(it["question"], it["answer"], it["kind"], it["subject"]) for it in items] == [
        (r["prompt"], r["solution"], "math", r["source"]) for r in kept]
    # The cache keeps the hub's raw rows, so the filter and field map apply again on every read.
    cached = [json.loads(line) for line in (tmp_path / "cache" / "bigmath" / "train.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in cached] == [r["prompt"] for r in rows]
    # Graded with math-verify: an equivalent form of each gold answer is right, a different one wrong.
    for it, equal in zip(items, ["0.875", "3, -3", "4\\pi"]):
        assert tasks.grade("math", f"... \\boxed{{{equal}}}", it["answer"], strict=True), (it["answer"], equal)
        assert not tasks.grade("math", "... \\boxed{5}", it["answer"], strict=True)
    hard = tasks.load_dataset("bigmath-hard", "train", data_dir=tmp_path / "cache")
    assert [it["question"] for it in hard] == [rows[1]["prompt"]]
    with pytest.raises(ValueError, match="splits \\['train'\\]"):
        tasks.load_dataset("bigmath", "test", data_dir=tmp_path / "cache")


def test_dapo_math_from_the_hub_layout(fake_hub, tmp_path):
    add, calls = fake_hub
    rows = fixture_rows("dapo_math_17k_processed.jsonl")
    add("open-r1/DAPO-Math-17k-Processed", {"en/train-00000-of-00001.parquet": rows,
                                            "cn/train-00000-of-00001.parquet": rows[:1]})
    items = tasks.load_dataset("dapo-math", "train", data_dir=tmp_path / "cache", limit=5)
    assert calls == [("open-r1/DAPO-Math-17k-Processed", "en/train-00000-of-00001.parquet")]
    assert len(items) == 2  # the third prompt is over the official 1024 characters
    assert items[0]["question"] == "How many positive divisors does $36$ have?"  # DAPO's wrapper removed
    assert [(it["answer"], it["id"], it["kind"]) for it in items] == [("9", "a1b2", "math"), ("12", "c3d4", "math")]
    assert "Answer:" not in tasks.get_task("math").messages(items[1]["question"])[0]["content"]
    assert tasks.grade("math", "so \\boxed{12}", items[1]["answer"], strict=True)


@pytest.mark.parametrize("name, repo", [("bigmath", "open-r1/Big-Math-RL-Verified-Processed"),
                                        ("dapo-math", "open-r1/DAPO-Math-17k-Processed")])
def test_offline_without_the_files_says_how_to_get_them(tmp_path, monkeypatch, name, repo):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(FileNotFoundError) as e:
        tasks.load_dataset(name, "train", data_dir=tmp_path)
    msg = str(e.value)
    assert str(tmp_path / name / "train.jsonl") in msg and "offline" in msg
    assert repo in msg and f"python tasks.py --data {name} --split train" in msg


def test_hand_written_cache_in_the_hub_schema(tmp_path):
    """The file the error message asks for: the hub's rows as jsonl, read through the same map."""
    (tmp_path / "bigmath").mkdir()
    rows = fixture_rows("big_math_rl_verified_processed.jsonl")
    (tmp_path / "bigmath" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = tasks.load_dataset("bigmath", "train", data_dir=tmp_path, limit=2)
    assert [it["answer"] for it in items] == ["\\frac{7}{8}", "\\pm 3"]
