"""runs.py: the run folder, case by case, each an argv or a file and the message it gives, with the folder's
files before and after. A live run's lock, held by a second real process, refuses a resume and --force until
that process is killed; a full disk (a real small filesystem) stops a checkpoint or the summary with one line
saying what is kept; data edited under a run, a tampered state.json or args.json, a crafted state.pt are
refused naming the file; divergence stops the run naming its last checkpoint. None of these trains: the run
folders are built by tests/test_train.py's helpers, and train.main stops at the model's loading."""
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

import hub
import runs
import train
from test_train import no_model, resumable, small_checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A second process that holds a run's lock, as a live train.py does, until it is killed.
LOCKER = "import sys, time, runs; lock = runs.RunLock(sys.argv[1]); print('locked', flush=True); time.sleep(600)"


def without_lock(files):
    return {f: h for f, h in files.items() if f != runs.LOCK}


def test_a_live_run_owns_its_folder_until_its_process_dies(tmp_path, monkeypatch, tree):
    """While another process holds the lock: is_live says so, a second RunLock, `--resume` and a new run with
    --force are refused naming that process (--force never deletes a live run), every file as it was. Once the
    process is SIGKILLed the OS has released the lock: the resume goes on, with no manual step, to the model's
    loading, and failing there changes nothing (the finished run's summary.json is not moved aside, args.json
    keeps its --steps)."""
    no_model(monkeypatch)
    out = str(tmp_path / "run")
    resumable(out, step=2, steps=2, summary_steps=2)  # a finished 2-step run, which --steps 4 extends
    child = subprocess.Popen([sys.executable, "-c", LOCKER, out], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "locked\n", child.communicate(timeout=60)[1]  # (else it died: why)
        before = tree(out)
        in_use = f"{out} is in use by a run that is still going (pid {child.pid} on {os.uname().nodename})"
        assert runs.is_live(out)
        with pytest.raises(hub.OutputError) as e:
            runs.RunLock(out)
        assert str(e.value) == f"{in_use}; wait for it to end or stop it, then resume it with --resume {out}"
        with pytest.raises(SystemExit) as e:
            train.main(["--resume", out, "--steps", "4"])
        assert str(e.value) == f"train.py: {in_use}; wait for it to end or stop it, then resume it with --resume {out}"
        assert tree(out) == before
        with pytest.raises(SystemExit) as e:
            train.main(["--steps", "2", "--eval-limit", "4", "--out", out, "--force"])
        assert str(e.value) == (f"train.py: --out {out} is in use by a run that is still going; --force never deletes "
                                f"a live run: stop it first, or name a new folder")
        assert tree(out) == before
    finally:
        child.send_signal(signal.SIGKILL)  # (no handler runs: only the OS can let go of the lock)
        child.communicate()
    assert not runs.is_live(out)
    with pytest.raises(AssertionError, match="a model was loaded"):  # past every check
        train.main(["--resume", out, "--steps", "4"])
    assert without_lock(tree(out)) == without_lock(before)  # (the lock file names its last holder, this process)
    assert json.load(open(os.path.join(out, "args.json")))["steps"] == 2


# The child's part of the full-disk tests: a run folder on the small filesystem, `fill(leave)` takes all its
# free space but `leave` bytes, `files(out)` is the folder's {path: sha256}.
ON_SMALL_FS = """
import hashlib, json, os, shutil, sys
sys.path.insert(0, "tests")
import hub, runs
from test_train import small_checkpoint
mnt = {mnt!r}

def fill(leave):
    st = os.statvfs(mnt)
    with open(os.path.join(mnt, "filler"), "wb") as f:
        f.write(bytes(st.f_bavail * st.f_frsize - leave))

def files(out):
    return {{os.path.relpath(os.path.join(d, n), out): hashlib.sha256(open(os.path.join(d, n), "rb").read()).hexdigest()
            for d, _, names in os.walk(out) for n in names}}
"""


def on_small_fs(small_fs, code):
    p = small_fs("1m", ON_SMALL_FS.format(mnt=small_fs.folder) + code)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_a_checkpoint_on_a_full_disk_keeps_the_last_one(small_fs):
    """save_checkpoint's second checkpoint on a filesystem with room for each of its files but the next, in the
    order it writes them (the adapter's weights, its config, state.pt, state.json): each time one line naming
    the path, the kernel's "No space left on device", and that the last checkpoint is kept; the folder's files
    as they were, checkpoint/ intact and no checkpoint.tmp left. (torch.save's own writer reports ENOSPC as a
    RuntimeError, and the adapter's writer said only that no adapter was written.)"""
    res = on_small_fs(small_fs, """
out = os.path.join(mnt, "run")
os.makedirs(out)
small_checkpoint(out, 1)
order = ["adapter/adapter_model.safetensors", "adapter/adapter_config.json", "state.pt", "state.json"]
pages = [os.stat(os.path.join(out, "checkpoint", f)).st_blocks * 512 for f in order]
results = []
for i, name in enumerate(order):
    before = files(out)
    fill(sum(pages[:i]))  # room for the files written before `name`, not for it
    try:
        small_checkpoint(out, 2)
        message = None
    except hub.OutputError as e:
        message = str(e)
    os.remove(os.path.join(mnt, "filler"))
    results.append({"fails": name, "message": message, "same": files(out) == before, "left": sorted(os.listdir(out))})
print(json.dumps({"out": out, "results": results}))
""")
    out = res["out"]
    for r in res["results"]:
        m = r["message"]
        assert m is not None and m.startswith(f"cannot write {out}/checkpoint.tmp"), r
        assert "No space left on device" in m and "\n" not in m, r
        assert m.endswith(f"; the last checkpoint, {out}/checkpoint, is kept"), r
        assert r["same"] and r["left"] == ["checkpoint"], r


def test_a_summary_on_a_full_disk_says_what_is_kept(small_fs):
    """write_summary on a full disk: one line naming summary.json and what the run keeps; no partial summary
    left behind (the shorter run's summary that this one extends stays, set aside under its step count)."""
    res = on_small_fs(small_fs, """
out = os.path.join(mnt, "run")
os.makedirs(out)
hub.write_json(os.path.join(out, "summary.json"), {"steps": 2, "final_accuracy": 0.5})
fill(0)
try:
    runs.write_summary(out, {"steps": 3, "final_accuracy": 0.75})
    message = None
except hub.OutputError as e:
    message = str(e)
print(json.dumps({"out": out, "message": message, "left": sorted(os.listdir(out)),
                  "aside": json.load(open(os.path.join(out, "summary.2-steps.json")))}))
""")
    out = res["out"]
    assert res["message"] == (f"cannot write {out}/summary.json: No space left on device; the run's checkpoint, "
                              f"metrics and adapter are kept"), res
    assert res["left"] == ["summary.2-steps.json"] and res["aside"] == {"steps": 2, "final_accuracy": 0.5}, res


def test_a_resume_refuses_data_edited_since_the_run_started(tmp_path, monkeypatch, tree):
    """A --data file edited between a run and its resume: resume_point (and so `--resume`) refuses it naming
    the file, the folder as it was; the file put back as it was resumes."""
    no_model(monkeypatch)
    data = tmp_path / "train.jsonl"
    original = "".join(json.dumps({"question": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n" for i in range(4))
    data.write_text(original)
    out = str(tmp_path / "run")
    resumable(out, step=1, steps=3)
    state = os.path.join(out, "checkpoint", "state.json")
    hub.write_json(state, {**json.load(open(state)), "data_sha256": runs.data_hash(str(data))})  # (as train.py saves)
    args = os.path.join(out, "args.json")
    hub.write_json(args, {**json.load(open(args)), "data": str(data), "eval_data": "arith"})
    assert runs.resume_point(out, "r", 3, str(data))[1]["step"] == 1
    data.write_text(original.replace("What is 3 + 2?", "What is 3 + 3?"))
    before = tree(out)
    message = (f"--data {data} changed since the run started (its content hash differs): resume with the file as "
               f"it was, or start a new run")
    with pytest.raises(ValueError) as e:
        runs.resume_point(out, "r", 3, str(data))
    assert str(e.value) == message
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", out])
    assert str(e.value) == f"train.py: {message}" and tree(out) == before
    data.write_text(original)
    with pytest.raises(AssertionError, match="a model was loaded"):
        train.main(["--resume", out])


@pytest.mark.parametrize("name,text,fragment", [
    ("checkpoint/state.json", '{"step": "3", "data_pos": 0, "run_id": "r", "samples_lines": 0, "baseline_accuracy": 0.5}',
     "cannot resume: {path} is damaged: step missing or not what a checkpoint writes"),
    ("checkpoint/state.json", '{"step": 1, "data_pos": null, "run_id": "r", "samples_lines": 0}',
     "cannot resume: {path} is damaged: data_pos, baseline_accuracy missing or not what a checkpoint writes"),
    ("checkpoint/state.json", '{"step": true, "data_pos": 0, "run_id": "r", "samples_lines": 0, "baseline_accuracy": 1}',
     "cannot resume: {path} is damaged: step missing or not what a checkpoint writes"),
    ("checkpoint/state.json", '[1, "r"]', "cannot resume: {path} is missing or damaged (ValueError: {path}: expected "
                                          "a JSON object, got list)"),
    ("args.json", '["--steps", "3"]', "cannot resume {out}: {path} is damaged ({path}: expected a JSON object, "
                                      "got list)"),
], ids=["state-step-a-string", "state-data-pos-null", "state-step-a-bool", "state-a-list", "args-a-list"])
def test_a_tampered_state_or_args_file_is_refused_naming_it(name, text, fragment, tmp_path, monkeypatch, tree):
    """A state.json or args.json of the wrong shape (a string step, a null data position, a list for the
    object): one line naming the file, no traceback, before any model loads, the folder as it was. (An
    args.json that is not JSON at all: tests/test_recipes.py.)"""
    no_model(monkeypatch)
    out = str(tmp_path / "run")
    resumable(out, step=1, steps=3)  # (one checkpoint: nothing to fall back on)
    path = os.path.join(out, name)
    with open(path, "w") as f:
        f.write(text)
    before = tree(out)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", out])
    message = str(e.value)
    assert message.startswith("train.py: ") and fragment.format(path=path, out=out) in message, message
    assert "\n" not in message and "Traceback" not in message
    assert tree(out) == before


class Payload:
    """Unpickling this calls os.makedirs(flag): what a crafted state.pt would do with os.system."""

    def __init__(self, flag):
        self.flag = flag

    def __reduce__(self):
        return os.makedirs, (self.flag,)


def test_a_crafted_state_pt_is_refused_in_one_whole_sentence(tmp_path, monkeypatch, tree):
    """A state.pt whose unpickling would run code: its code does not run, and the message says in full why the
    file is refused and what to do, never suggesting weights_only=False (which would run it)."""
    no_model(monkeypatch)
    out = str(tmp_path / "run")
    resumable(out, step=1, steps=3)
    flag, pt = str(tmp_path / "the-code-ran"), os.path.join(out, "checkpoint", "state.pt")
    torch.save({"optimizer": Payload(flag), "scheduler": {}, "rng": {}}, pt)
    before = tree(out)
    with pytest.raises(SystemExit) as e:
        train.main(["--resume", out])
    assert str(e.value) == (f"train.py: cannot resume: {pt} holds objects other than tensors and plain values "
                            f"(pickled code, or a checkpoint of an older train.py), which --resume never loads. "
                            f"Start the run again without --resume (in a new --out, or with --force)")
    assert "weights_only" not in str(e.value) and not os.path.exists(flag) and tree(out) == before


def test_divergence_stops_the_run_naming_its_last_checkpoint(tmp_path, tree):
    """check_finite after a step: a NaN or infinite trainable tensor, or three skipped steps in a row, stop the
    run saying it diverged, with the last checkpoint's path (or that none was written); one or two skipped
    steps in a row, finite tensors: nothing. The folder is not touched."""
    out = str(tmp_path)
    finite = [torch.zeros(2, 3), torch.ones(4)]
    nan = [torch.zeros(2, 3), torch.tensor([1.0, float("nan"), 0.0, 0.0])]
    inf = [torch.tensor([float("inf")]), torch.tensor([float("-inf")])]
    advice = "start a new run with a lower --lr (or a smaller --grad-clip)"
    for written in (False, True):
        if written:
            small_checkpoint(out, 4)
        kept = (f"Its last good checkpoint is {os.path.join(out, 'checkpoint')}; " if written
                else "No checkpoint was written before; ")
        before = tree(out)
        for skipped in ([], [5], [4, 5]):
            assert runs.check_finite(finite, 6, skipped, out) is None
        for params, why in ((nan, "1 trainable tensors hold NaN or infinity after step 5"),
                            (inf, "2 trainable tensors hold NaN or infinity after step 5")):
            with pytest.raises(SystemExit) as e:
                runs.check_finite(params, 6, [], out)
            assert str(e.value) == f"train.py: the run diverged: {why}. {kept}{advice}"
        with pytest.raises(SystemExit) as e:
            runs.check_finite(finite, 6, [3, 4, 5], out)
        assert str(e.value) == (f"train.py: the run diverged: the loss or gradient was non-finite at steps 3, 4, 5. "
                                f"{kept}{advice}")
        assert tree(out) == before
