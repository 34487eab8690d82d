"""eval.py: the pass@k estimator, the CLI end to end on the tiny policy, that an adapter is applied, default
folders unique per input, lengths checked against the model's positions, and results kept as they come
(a crash, a full disk: simulated, and on a real small filesystem where one can be made)."""

import hashlib
import itertools
import json
import os
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
    digest = hashlib.sha256(os.fsencode(os.path.realpath("some/dir/probs.jsonl"))).hexdigest()[:8]
    assert f == os.path.join("runs", "eval", f"tiny-bf16-probs-{digest}")


def test_default_out_is_unique_per_input_and_keeps_unicode(tmp_path, monkeypatch):
    """Two test sets of the same file name (a/test.jsonl, b/test.jsonl), two adapters or models of the same
    folder name: each gets its own folder (the hash of where it lies), the same input always the same one
    (a relative path and its absolute form too). Names keep letters of any script and spaces; only path
    separators and control characters become '_'; a very long name is cut, its hash kept."""
    import os

    monkeypatch.chdir(tmp_path)
    for d in ("a", "b", "tí ny", "模型"):
        (tmp_path / d).mkdir()
        (tmp_path / d / "test.jsonl").write_text("{}")
    out = lambda *a: ev.default_out(ev.parse_args(list(a)))  # noqa: E731
    a, b = out("--data", "a/test.jsonl"), out("--data", "b/test.jsonl")
    assert a != b and a == out("--data", str(tmp_path / "a" / "test.jsonl")) and "-test-" in a
    assert out("--model", "tí ny") != out("--model", "a") and "tí ny-" in out("--model", "tí ny")
    assert os.path.basename(out("--model", "模型")).startswith("模型-")
    assert out("--adapter", "a") != out("--adapter", "b")
    assert "-nvfp4-_z-" in out("--data", "x/\x07z.jsonl") and "-nvfp4-x_y-" in out("--data", "x\ny.jsonl")
    assert out("--model", "Qwen/Qwen2.5-7B-Instruct").endswith("Qwen_Qwen2.5-7B-Instruct-nvfp4-arith-test")
    long = out("--data", "é" * 300 + ".jsonl")
    assert len(os.path.basename(long).encode()) < 255 and long != out("--data", "é" * 299 + ".jsonl")


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


def test_a_budget_beyond_the_models_positions_is_refused_before_sampling(monkeypatch):
    """evaluate() (train.py's held-out eval too) refuses a prompt plus max_new_tokens beyond the model's
    max_position_embeddings, saying what fits, before a KV cache of that length is allocated; the CLI's
    fit_budget cuts a default budget to what fits and refuses a budget that was asked for."""
    import hub
    import model
    import rollout

    def no_sampling(*a, **k):
        raise AssertionError("sampled")

    m = model.Transformer.from_pretrained("tiny", dtype=torch.float32)
    tok = hub.load_tokenizer("tiny")
    items = data.load_dataset("arith", limit=2)
    longest = max(len(tasks.get_task("gsm8k").prompt_ids(tok, it["question"])) for it in items)
    monkeypatch.setattr(rollout, "generate", no_sampling)
    with pytest.raises(ValueError, match=f"max_new_tokens 10000000: the longest prompt has {longest} tokens and the "
                                         f"model takes 512 positions .* so at most {512 - longest} new tokens fit"):
        ev.evaluate(m, tok, items, max_new_tokens=10**7)
    args = ev.parse_args(["--data", "gsm8k"])
    assert ev.fit_budget(items, tok, args, 512, 512) == (512 - longest, f" (the default 512 cut to fit the model's "
                                                                        f"512 positions)")
    assert ev.fit_budget(items, tok, args, 64, 512) == (64, "") and ev.fit_budget(items, tok, args, 10**7, None) == (10**7, "")
    with pytest.raises(ValueError, match=f"--max-new-tokens 500: .* pass --max-new-tokens {512 - longest} or less"):
        ev.fit_budget(items, tok, ev.parse_args(["--max-new-tokens", "500"]), 500, 512)


def test_force_help_is_hubs(capsys):
    """--help says what --force does in hub's words, the same in every CLI."""
    import hub

    with pytest.raises(SystemExit):
        ev.parse_args(["--help"])
    assert " ".join(hub.FORCE_HELP.split()) in " ".join(capsys.readouterr().out.split())


SMALL_RUN = ["--data", "arith", "--limit", "6", "--batch-size", "2", "--max-new-tokens", "4", "--temperature", "0",
             "--quant", "bf16"]  # three batches of two problems


def test_a_crash_keeps_the_batches_graded_before_it(tmp_path, monkeypatch):
    """samples.jsonl grows as batches are graded: a crash in the third batch keeps the first two, whole."""
    import rollout

    real, calls = rollout.generate, []

    def crashing(*a, **k):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("the machine fell over")
        return real(*a, **k)

    monkeypatch.setattr(rollout, "generate", crashing)
    out = tmp_path / "e"
    with pytest.raises(RuntimeError, match="fell over"):
        ev.main(SMALL_RUN + ["--out", str(out)])
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3] and not (out / "summary.json").exists()


def test_a_full_disk_stops_with_one_line_and_keeps_what_was_graded(tmp_path, monkeypatch):
    """A full disk (ENOSPC) in the third batch's write, which had got half of it onto the disk: one line
    naming samples.jsonl and what it keeps, and the file cut back to the two whole batches before. The
    disk filling at the summary: one line naming summary.json, every completion kept in samples.jsonl."""
    import hub

    real_write, writes = os.write, []

    def write(fd, data):
        if os.readlink(f"/proc/self/fd/{fd}").endswith("samples.jsonl"):
            writes.append(fd)
            if len(writes) == 3:
                real_write(fd, bytes(data)[: len(data) // 2])
                raise OSError(28, "No space left on device")
        return real_write(fd, data)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("no /proc/self/fd to tell the samples file's writes apart")
    out = tmp_path / "e"
    with monkeypatch.context() as m:
        m.setattr(os, "write", write)
        with pytest.raises(SystemExit) as e:
            ev.main(SMALL_RUN + ["--out", str(out)])
    assert e.value.code == (f"eval.py: cannot write {out}/samples.jsonl: No space left on device; it keeps the 4 "
                            f"completions graded before, whole lines")
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3]
    real_json = hub.write_json

    def write_json(path, obj):
        if path.endswith("summary.json"):
            raise OSError(28, "No space left on device")
        return real_json(path, obj)

    monkeypatch.setattr(hub, "write_json", write_json)
    with pytest.raises(SystemExit) as e:
        ev.main(SMALL_RUN + ["--out", str(out)])
    assert e.value.code == (f"eval.py: cannot write {out}/summary.json: No space left on device; every completion and "
                            f"its grade are in {out}/samples.jsonl")
    assert len((out / "samples.jsonl").read_text().splitlines()) == 6 and not (out / "summary.json").exists()


def test_a_full_disk_on_a_real_small_filesystem(small_fs):
    """The same on a real filesystem that fills up (a tmpfs of two pages: the marker takes one, the samples
    file the other): the kernel's own ENOSPC, one line, whole lines kept, the count in the message right."""
    code = f"""
import json, os
import eval as ev
out = os.path.join({small_fs.folder!r}, "e")
try:
    ev.main({SMALL_RUN[:3] + ["24", "--batch-size", "4"] + SMALL_RUN[6:]!r} + ["--out", out])
    message = None
except SystemExit as e:
    message = str(e.code)
lines = open(os.path.join(out, "samples.jsonl")).read().splitlines()
print(json.dumps({{"message": message, "index": [json.loads(x)["index"] for x in lines], "files": sorted(os.listdir(out))}}))
"""
    p = small_fs("8k", code)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    kept = len(res["index"])
    assert 0 < kept < 24 and kept % 4 == 0 and res["index"] == sorted(res["index"])
    assert res["message"].startswith(f"eval.py: cannot write {small_fs.folder}/e/samples.jsonl: No space left on "
                                     f"device; it keeps the {kept} completions graded before, whole lines"), res
    assert "summary.json" not in res["files"]
