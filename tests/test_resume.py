"""train.py's checkpoints and --resume, on one short run of the tiny policy copied for each test: a
checkpoint is tensors and JSON, and a crafted state.pt does not run its code; a damaged checkpoint falls
back to the one before it, or stops naming the files; --resume keeps the run's settings, refuses others,
and extends a finished run with a larger --steps (its wall time counting every part); a new run never
inherits a checkpoint it did not write."""
import json
import os
import shutil
import sys
import types

import pytest
import torch

import runs
import train

ARGS = ["--steps", "2", "--prompts", "2", "--group-size", "2", "--eval-limit", "4", "--max-new-tokens", "16",
        "--save-every", "1", "--eval-every", "0", "--seed", "1"]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("base") / "run")
    train.main(ARGS + ["--out", out])
    return out


@pytest.fixture
def run(finished, tmp_path):
    """A copy of the finished run, to change at will."""
    out = str(tmp_path / "run")
    shutil.copytree(finished, out)
    return out


def rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def no_model(monkeypatch):
    def load(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(train, "load_policy", load)


class Payload:
    """Unpickling this calls os.makedirs(flag): what a crafted state.pt would do with os.system."""

    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return os.makedirs, (self.flag,)


def test_a_checkpoint_is_tensors_and_json(run):
    path = os.path.join(run, "checkpoint")
    state = torch.load(os.path.join(path, "state.pt"), weights_only=True)  # (would raise on anything else)
    assert set(state) == {"optimizer", "scheduler", "rng"}
    assert all(isinstance(t, torch.Tensor) for t in state["rng"].values())
    with open(os.path.join(path, "state.json")) as f:
        meta = json.load(f)
    assert meta["step"] == 2 and meta["run_id"] == json.load(open(os.path.join(run, "args.json")))["run_id"]
    assert runs.read_checkpoint(os.path.join(run, "checkpoint.old"), meta["run_id"])["step"] == 1


def test_a_crafted_state_pt_does_not_run(run, tmp_path, monkeypatch):
    flag = str(tmp_path / "the-code-ran")
    for name in ("checkpoint", "checkpoint.old"):
        torch.save({"optimizer": Payload(flag), "scheduler": {}, "rng": {}}, os.path.join(run, name, "state.pt"))
    os.remove(os.path.join(run, "summary.json"))
    no_model(monkeypatch)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", run])
    assert not os.path.exists(flag)
    message = str(e.value)
    for name in ("checkpoint", "checkpoint.old"):
        assert f"{os.path.join(run, name, 'state.pt')} holds objects other than tensors and plain values" in message
    assert message.startswith("train.py: cannot resume: ") and "never loads" in message


def test_a_damaged_checkpoint_falls_back_to_the_one_before(run, capsys, monkeypatch):
    os.remove(os.path.join(run, "summary.json"))  # as if killed before the final evaluation
    pt = os.path.join(run, "checkpoint", "state.pt")
    data = open(pt, "rb").read()
    open(pt, "wb").write(data[: len(data) // 3])
    summary = train.main(["--resume", run])  # from checkpoint.old (step 1): step 1 again, then the end
    err = capsys.readouterr().err
    assert f"{pt} is damaged or not a checkpoint" in err and "resuming from the checkpoint before it" in err
    assert [r["step"] for r in rows(run)] == [0, 1] and summary["steps"] == 2
    # With both damaged: a message naming both files, before any model loads.
    for name in ("checkpoint", "checkpoint.old"):
        open(os.path.join(run, name, "state.pt"), "wb").write(b"not a checkpoint")
    os.remove(os.path.join(run, "summary.json"))
    no_model(monkeypatch)
    with pytest.raises(SystemExit, match=r"checkpoint/state.pt is damaged .*checkpoint.old/state.pt is damaged"):
        train.main(["--resume", run])


def test_resume_keeps_the_settings_and_extends_a_finished_run(run, monkeypatch, capsys):
    no_model(monkeypatch)
    for argv, message in ((["--resume", run], "the run has done 2 steps; pass a larger --steps with --resume to extend it"),
                          (["--resume", run, "--steps", "3", "--lr", "0.1", "--algo", "grpo"],
                           "--lr 0.1 (the run's: 0.002), --algo grpo (the run's: dapo)"),
                          (["--resume", run, "--steps", "3", "--out", run + "-other"], f"drop --out {run}-other")):
        with pytest.raises(SystemExit) as e:
            train.main(argv)
        assert message in str(e.value), str(e.value)
    monkeypatch.undo()
    logged = []  # --log wandb, with a stand-in for the optional package
    fake = types.SimpleNamespace(init=lambda **kw: types.SimpleNamespace(
        log=lambda d, step: logged.append((step, d)), finish=lambda: logged.append("finished")))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    before = json.load(open(os.path.join(run, "wall_time.json")))["parts_s"]
    summary = train.main(["--resume", run, "--steps", "3", "--log", "wandb", "--model", "tiny"])  # (the same model: fine)
    out = capsys.readouterr().out
    assert "keeping its settings" in out and "changed: --steps 2 -> 3" in out
    got = rows(run)
    assert [r["step"] for r in got] == [0, 1, 2] and summary["steps"] == 3
    assert json.load(open(os.path.join(run, "summary.2-steps.json")))["steps"] == 2  # the shorter run's, kept
    assert summary["baseline_accuracy_strict"] is not None  # (every figure survives a resume)
    args = json.load(open(os.path.join(run, "args.json")))
    assert args["steps"] == 3 and args["schedule_steps"] == 2
    assert got[2]["lr"] == pytest.approx(args["lr"] * args["min_lr_ratio"])  # the extra step at the schedule's floor
    parts = json.load(open(os.path.join(run, "wall_time.json")))["parts_s"]
    assert parts[:-1] == before and len(parts) == 2
    assert summary["wall_time_s"] == pytest.approx(sum(parts)) and summary["wall_time_s"] > before[0]
    assert logged[0][0] == 2 and "lr" in logged[0][1] and logged[-1] == "finished"
    assert any("heldout_accuracy" in d for s, d in logged[:-1])


def test_a_new_run_never_inherits_a_checkpoint(run, monkeypatch):
    no_model(monkeypatch)
    with pytest.raises(SystemExit, match=f"--out {run} holds an earlier run; continue it with --resume {run}"):
        train.main(ARGS + ["--out", run])
    assert os.path.exists(os.path.join(run, "checkpoint", "state.pt"))  # untouched
    # A checkpoint that another run wrote (copied in, or left over) is refused by --resume.
    with open(os.path.join(run, "args.json")) as f:
        saved = json.load(f)
    with open(os.path.join(run, "args.json"), "w") as f:
        json.dump({**saved, "run_id": "another-run"}, f)
    os.remove(os.path.join(run, "summary.json"))
    with pytest.raises(SystemExit, match="belongs to another run .*a run resumes only from checkpoints it wrote"):
        train.main(["--resume", run])
    # --force: the earlier run is deleted before the new one starts, which has a run id of its own.
    with pytest.raises(AssertionError, match="a model was loaded"):
        train.main(ARGS + ["--out", run, "--force"])
    assert sorted(os.listdir(run)) == [runs.LOCK, ".qerl-output.json"]  # (the lock file stays; its lock went with the run)
    with open(os.path.join(run, ".qerl-output.json")) as f:
        assert json.load(f)["run_id"] not in (saved["run_id"], "another-run")
