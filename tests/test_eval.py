"""eval.py: the pass@k estimator, the CLI end to end on the tiny policy, and that an adapter is applied."""

import itertools
import json
import random
import sys
from math import comb
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import data  # noqa: E402
import eval as ev  # noqa: E402
import tasks  # noqa: E402


def test_pass_at_k_hand_values():
    assert ev.pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert ev.pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert ev.pass_at_k(10, 3, 5) == pytest.approx(1 - 21 / 252)  # 1 - C(7,5)/C(10,5)
    assert ev.pass_at_k(4, 0, 3) == 0.0
    assert ev.pass_at_k(4, 3, 2) == 1.0  # only one wrong sample: any 2 contain a right one
    assert ev.pass_at_k(8, 8, 8) == 1.0
    with pytest.raises(ValueError):
        ev.pass_at_k(4, 5, 1)


def test_pass_at_k_is_the_subset_average():
    """pass@k = the fraction of k-subsets of the n samples holding a right one, counted by brute force."""
    rng = random.Random()
    for _ in range(20):
        n = rng.randint(1, 9)
        c, k = rng.randint(0, n), rng.randint(1, n)
        flags = [1] * c + [0] * (n - c)
        subsets = list(itertools.combinations(flags, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert ev.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)
        assert len(subsets) == comb(n, k)
    assert ev.ks_for(8) == [1, 2, 4, 8] and ev.ks_for(6) == [1, 2, 4, 6] and ev.ks_for(1) == [1]


def test_cli_on_tiny_writes_summary_and_graded_samples(tmp_path):
    out = tmp_path / "e"
    summary = ev.main(["--data", "arith", "--limit", "16", "--samples", "2", "--temperature", "1.0", "--top-p", "1.0",
                       "--out", str(out), "--seed", str(random.randrange(1000))])
    on_disk = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert on_disk["n"] == 16 and on_disk["samples"] == 2 and len(rows) == 32
    assert on_disk["accuracy"] == pytest.approx(summary["accuracy"])
    # Every grade is the task's judge applied to the stored completion, and the summary is their mean.
    for r in rows:
        assert r["correct"] == tasks.grade("gsm8k", r["completion"], r["gold"])
    assert on_disk["accuracy"] == pytest.approx(sum(r["correct"] for r in rows) / 32)
    per_item = [sum(r["correct"] for r in rows if r["index"] == i) for i in range(16)]
    assert on_disk["pass@k"]["2"] == pytest.approx(sum(c > 0 for c in per_item) / 16)
    # The tiny policy does the task (through NVFP4, our model and rollout.generate), but not always.
    assert 0.05 < on_disk["accuracy"] < 0.95, on_disk["accuracy"]
    assert all(r["finish"] in ("stop", "length") for r in rows) and on_disk["mean_length"] < 64


def test_missing_or_malformed_input_fails_clearly(tmp_path):
    """A missing model or adapter folder, a malformed jsonl: one message naming it, before any loading."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1", "answer": "2"}\n[1, 2]\n')
    for argv, message in ((["--model", "no-such-model"], "not a hub id"),
                          (["--adapter", str(tmp_path / "none")], "no adapter folder"),
                          (["--data", str(bad)], f"{bad}:2:")):
        with pytest.raises(SystemExit) as e:
            ev.main(argv + ["--out", str(tmp_path / "e")])
        assert str(e.value).startswith("eval.py: ") and message in str(e.value), str(e.value)
    assert not (tmp_path / "e").exists()


def test_breakdown_by_level_and_subject():
    """MATH-style items carry level and subject; the summary groups avg@K by them."""
    import hub
    import model

    items = [{"question": f"What is {a} + {b}?", "answer": str(a + b), "kind": "gsm8k", "level": lvl, "subject": subj}
             for a, b, lvl, subj in [(2, 3, 1, "Algebra"), (4, 4, 2, "Algebra"), (7, 1, 2, "Geometry")]]
    m = model.Transformer.from_pretrained("tiny", dtype=torch.float32)
    tok = hub.load_tokenizer("tiny")
    res = ev.evaluate(m, tok, items, samples=3, temperature=1.0, top_p=1.0, max_new_tokens=8, batch_size=4, seed=1)
    assert {k: v["n"] for k, v in res["by_level"].items()} == {"1": 3, "2": 6}
    assert {k: v["n"] for k, v in res["by_subject"].items()} == {"Algebra": 6, "Geometry": 3}
    assert len(res["records"]) == 9 and sorted(res["pass@k"]) == [1, 2, 3]
    # Prompts split over calls (batch_size 4 // 3 samples = 1 prompt a call) keep their item index.
    assert [r["index"] for r in res["records"]] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_adapter_changes_the_result(tmp_path):
    """The official QeRL eval silently evaluated the base model. Here a LoRA adapter with nonzero B,
    saved in PEFT format and passed with --adapter, must change the greedy completions, while a B = 0
    adapter (the identity) must not: the difference comes from the adapter's values, not the path."""
    import adapters
    import lora
    import model

    def make_adapter(path, scale):
        m = model.Transformer.from_pretrained("tiny", dtype=torch.float32)
        lora.apply_lora(m, rank=4, alpha=8)
        gen = torch.Generator().manual_seed(random.randrange(1000))
        for mod in lora.lora_modules(m).values():
            mod.lora_B.weight.data = torch.randn(mod.lora_B.weight.shape, generator=gen) * scale
        adapters.save_adapter(m, str(path))

    make_adapter(tmp_path / "noisy", 0.5)
    make_adapter(tmp_path / "zero", 0.0)
    common = ["--data", "arith", "--limit", "12", "--temperature", "0", "--quant", "bf16"]
    runs = {}
    for name, extra in [("base", []), ("noisy", ["--adapter", str(tmp_path / "noisy")]),
                        ("zero", ["--adapter", str(tmp_path / "zero")])]:
        ev.main(common + extra + ["--out", str(tmp_path / f"out-{name}")])
        lines = (tmp_path / f"out-{name}" / "samples.jsonl").read_text().splitlines()
        runs[name] = [json.loads(line) for line in lines]
    texts = {k: [r["completion"] for r in v] for k, v in runs.items()}
    assert texts["zero"] == texts["base"]
    assert sum(a != b for a, b in zip(texts["noisy"], texts["base"])) >= 6
    acc = {k: sum(r["correct"] for r in v) for k, v in runs.items()}
    assert acc["noisy"] < acc["base"], acc


def test_default_out_names_what_is_evaluated():
    """The default folder names the quant and the split, so an NVFP4 and a bf16 evaluation of the same model
    (or the train and test splits) land in different folders instead of replacing each other's results."""
    import os

    out = lambda *a: ev.default_out(ev.parse_args(["--data", "gsm8k", *a]))  # noqa: E731
    assert out() == os.path.join("runs", "eval", "tiny-nvfp4-gsm8k-test")
    assert out("--quant", "bf16") == os.path.join("runs", "eval", "tiny-bf16-gsm8k-test")
    assert out("--split", "train") != out() and out("--adapter", "runs/x/adapter") != out()
    # a file is read whole whatever --split says, so the split is not in its name
    f = ev.default_out(ev.parse_args(["--data", "some/dir/probs.jsonl", "--quant", "bf16"]))
    assert f == os.path.join("runs", "eval", "tiny-bf16-probs")


def test_cli_prompt_style_is_used_and_recorded(tmp_path, monkeypatch):
    """Every prompt style (tasks.PROMPT_STYLES: ours, paper, official, bare) is a --prompt choice, asks
    through tasks.get_task in that style (as train.py --prompt trains), and is recorded in the summary."""
    seen = []
    real = tasks.get_task
    monkeypatch.setattr(tasks, "get_task", lambda kind, prompt="ours": seen.append(prompt) or real(kind, prompt))
    common = ["--data", "arith", "--limit", "2", "--max-new-tokens", "4", "--temperature", "0"]
    for style in tasks.PROMPT_STYLES:
        seen.clear()
        summary = ev.main(common + ["--prompt", style, "--out", str(tmp_path / style)])
        assert set(seen) == {style}
        assert json.loads((tmp_path / style / "summary.json").read_text())["prompt"] == style == summary["prompt"]
    assert ev.parse_args([]).prompt == "ours"
    with pytest.raises(SystemExit):
        ev.parse_args(["--prompt", "nope"])


def test_evaluate_reports_strict_next_to_lenient():
    """Each completion graded both ways (tasks.grade), and the summary's strict figures from those grades."""
    import hub
    import model

    items = data.load_dataset("arith", "test", limit=12)
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
