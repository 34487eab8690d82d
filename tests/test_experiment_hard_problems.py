"""experiments/hard_problems.py: a problem is kept when none of its samples is right, in its order; the kept
problems are written where countdown.load_hard and `--data countdown-hard` read them, with the selection's
record; load_hard refuses what it cannot give."""
import json
import os

import pytest
import torch

import countdown
import data
import eval as evaluation
from experiments import calibrate, hard_problems


def test_a_problem_is_kept_when_no_sample_is_right(monkeypatch):
    items = countdown.load("train", 5, seed=0)
    right = {0: [0, 0, 1], 1: [0, 0, 0], 2: [1, 1, 1], 3: [0, 0, 0], 4: [0, 1, 0]}  # item -> its samples' grades
    seen = {}

    def evaluate(model, tokenizer, its, **kw):
        seen.update(kw)
        return {"records": [{"index": i, "correct": bool(c)} for i, cs in right.items() for c in cs]}

    monkeypatch.setattr(evaluation, "evaluate", evaluate)
    kept, pass1 = hard_problems.unsolved(None, None, items, samples=3, max_new_tokens=80, batch_size=None)
    assert kept == [items[1], items[3]] and pass1 == pytest.approx(5 / 15)
    assert seen["samples"] == 3 and seen["temperature"] == 1.0 and seen["top_p"] == 1.0 and seen["kind"] == "countdown"


def test_the_kept_problems_are_what_countdown_hard_reads(tmp_path, monkeypatch):
    """End to end on the CPU with the replication's policy (a few problems, a few samples): train.jsonl and
    test.jsonl hold countdown.load's records of their split, in order, as many as selection.json says; load_hard
    and data.load_dataset('countdown-hard') read them back, and calibrate's problems() asks them as Countdown."""
    out = tmp_path / "hard"
    summary = hard_problems.main(["--out", str(out), "--train", "6", "--test", "4", "--samples", "2",
                                  "--device", "cpu"])
    for split, n in (("train", 6), ("test", 4)):
        kept = [json.loads(line) for line in open(out / f"{split}.jsonl")]
        candidates = countdown.load(split, n, seed=0)
        assert [c for c in candidates if c in kept] == kept and len(kept) == summary["splits"][split]["kept"]
        assert countdown.load_hard(split, folder=out) == kept
    record = json.loads((out / "selection.json").read_text())
    assert record["samples"] == 2 and record["splits"]["test"]["candidates"] == 4 and "--train 6" in record["command"]
    assert record["device"] == hard_problems.device_name(torch.device("cpu")) != ""
    if os.path.exists("/proc/cpuinfo") and "model name" in open("/proc/cpuinfo").read():  # (Linux names its CPU)
        assert record["device"] in open("/proc/cpuinfo").read()
    monkeypatch.setattr(countdown, "HARD_DIR", out)
    test = countdown.load_hard("test")
    assert [r["question"] for r in data.load_dataset("countdown-hard", "test")] == [r["question"] for r in test]
    assert all(r["kind"] == "countdown" for r in data.load_dataset("countdown-hard", "train"))
    syn, items = calibrate.problems("countdown-hard", len(test))
    assert syn.name == "countdown" and items == test


def test_load_hard_refuses_what_it_cannot_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="experiments/hard_problems.py"):
        countdown.load_hard("test", folder=tmp_path)
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in countdown.load("test", 3)))
    assert len(countdown.load_hard("test", folder=tmp_path)) == 3
    assert countdown.load_hard("test", 2, folder=tmp_path) == countdown.load("test", 2)
    with pytest.raises(ValueError, match="holds 3 problems, not 4"):
        countdown.load_hard("test", 4, folder=tmp_path)
    with pytest.raises(ValueError, match="seed must be 0"):
        countdown.load_hard("test", seed=1, folder=tmp_path)
    with pytest.raises(ValueError, match="split must be one of"):
        countdown.load_hard("valid", folder=tmp_path)
