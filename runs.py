"""runs.py: a training run's folder. Who owns it, what a checkpoint holds, how a run resumes exactly.

A run writes into one folder (--out) as it goes, and a crash, a kill or a full disk at any moment must
leave a folder that either resumes to the same run or says exactly what is wrong:

    OUT/.qerl-output.json   the marker: train.py wrote this folder, and which run (its run id)
        .lock               held (an OS file lock) by the process running it, for the process's life
        args.json           the run's settings (recipes.parse): --resume reads them back
        metrics.jsonl       one line a step, samples.jsonl a few completions a step (logs.py)
        checkpoint/         adapter/ (PEFT), state.pt (optimizer, scheduler, RNG: tensors only),
                            state.json (step, data position, the baseline's figures, ...)
        checkpoint.old/     the one before, to fall back on if the newest is found damaged
        wall_time.json      the seconds of each process that ran the run (a resumed run has several)
        summary.json        written when the run ends (its step count says which run it describes)

One live process a folder. The lock is an flock on OUT/.lock, taken before the run changes anything in
the folder and released by the operating system when the process ends, however it ends: a second run or
a --resume refuses a folder whose lock is held (naming the process), and a killed run resumes with no
manual step. (flock is advisory and local: a folder on a network filesystem shared by two machines is
not protected.)

Checkpoints are written whole or not at all: built in checkpoint.tmp, then swapped in by two renames with
SIGINT/SIGTERM held off, the previous one kept as checkpoint.old. state.pt holds only tensors and plain
values and is read with torch.load(weights_only=True), so a crafted file cannot run code. A checkpoint
belongs to one run (its run id): a run resumes only from checkpoints it wrote. The data file's content
hash is kept too: a resume refuses training data that changed under it.
"""
import fcntl
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import signal
import sys
import time

import numpy as np
import torch

import adapters
import hub

LOCK = ".lock"


class RunLock:
    """An exclusive lock on OUT/.lock for this process's life (or until release). Raises hub.OutputError
    when another live process holds it."""

    def __init__(self, out):
        self.path = os.path.join(out, LOCK)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise hub.OutputError(in_use(out)) from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {os.uname().nodename}".encode(), 0)

    def release(self):
        if self.fd is not None:
            os.close(self.fd)  # (closing the last descriptor releases the flock)
            self.fd = None


def in_use(out):
    """The line that refuses `out` while a live process holds its lock, naming the process (as the lock file
    names its holder)."""
    try:
        with open(os.path.join(out, LOCK), errors="replace") as f:
            holder = f.read(200).strip()
    except OSError:
        holder = ""
    return (f"{out} is in use by a run that is still going ({holder or 'another process'}); wait for it to end or "
            f"stop it, then resume it with --resume {out}")


def is_live(out):
    """Whether a live process holds `out`'s run lock."""
    path = os.path.join(out, LOCK)
    if not os.path.exists(path):
        return False
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def default_out(run_id):
    """runs/<timestamp>-<the run id's first 6 hex digits>: unique for runs started in the same second."""
    return os.path.join("runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id[:6]}")


def started_run(out):
    """Whether a train.py run was started in `out`, finished or not, perhaps still running: its marker
    names a run id (the first write of a run), or it holds a run's args.json, checkpoint or metrics."""
    metrics = os.path.join(out, "metrics.jsonl")
    return bool(hub.read_marker(out).get("run_id") or os.path.exists(os.path.join(out, "args.json"))
                or find_checkpoint(out) or (os.path.exists(metrics) and os.path.getsize(metrics) > 0))


def summary_steps(out):
    """The step count of the run's summary.json (written when a run of that many steps finished), or None."""
    try:
        steps = hub.read_json(os.path.join(out, "summary.json")).get("steps")
    except (OSError, ValueError, AttributeError):
        return None
    return steps if isinstance(steps, int) else None


def open_run(out, run_id, resume, sources, force=False):
    """The run's folder, locked by this process: a resumed run's own, or a new one that holds no earlier
    run (hub.check_out's rules; a folder where a train.py run was started only with --force, which deletes
    it first, and never while its run is alive). → the RunLock."""
    if resume:
        return RunLock(out)
    state = hub.check_out(out, "train.py", sources=sources, force=force)
    if state != "new" and is_live(out):
        raise hub.OutputError(f"--out {out} is in use by a run that is still going; --force never deletes a live "
                              f"run: stop it first, or name a new folder")
    if state == "ours" and started_run(out) and not force:
        if find_checkpoint(out):
            raise hub.OutputError(f"--out {out} holds an earlier run; continue it with --resume {out}, or pass "
                                  f"--force to delete it and start over, or name a new folder")
        raise hub.OutputError(f"--out {out} holds a run started earlier that has no checkpoint yet (it may still be "
                              f"running, or it stopped before its first: nothing to resume); pass --force to delete "
                              f"it and start over, or name a new folder")
    if state != "new":
        shutil.rmtree(out)  # (an earlier train.py run, or a folder --force lets go; never a new run in its files)
    hub.claim_folder(out, "train.py", force=force)
    lock = RunLock(out)
    hub.mark(out, "train.py", run_id=run_id)
    return lock


def data_hash(path):
    """sha256 of a --data file (None for a named set), so that a resume notices data edited under it."""
    if path is None or not os.path.isfile(path):
        return None
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------

def rng_state():
    """Every RNG the run draws from, as tensors and JSON numbers (a checkpoint holds nothing else, so
    loading one can never run code): (tensors, json)."""
    version, words, gauss = random.getstate()  # words: MT19937's 624 words and its position
    np_state = np.random.get_state(legacy=False)
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64),
               "numpy": torch.from_numpy(np_state["state"]["key"].astype(np.int64))}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    meta = {"python_version": version, "python_gauss": gauss, "numpy_pos": int(np_state["state"]["pos"]),
            "numpy_has_gauss": int(np_state["has_gauss"]), "numpy_gauss": float(np_state["gauss"])}
    return tensors, meta


def set_rng_state(tensors, meta):
    random.setstate((meta["python_version"], tuple(tensors["python"].tolist()), meta["python_gauss"]))
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": tensors["numpy"].numpy().astype(np.uint32),
                                                               "pos": meta["numpy_pos"]},
                         "has_gauss": meta["numpy_has_gauss"], "gauss": meta["numpy_gauss"]})
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])


def save_checkpoint(out, model, optimizer, scheduler, state):
    """Write out/checkpoint atomically: build it in checkpoint.tmp, then swap it in by renames; the one
    before stays as checkpoint.old. Signals that would kill the process are held off during the swap. A
    write that fails (a full disk) removes checkpoint.tmp and raises hub.OutputError: the run stops with
    its last checkpoint intact. What it holds: adapter/ (PEFT), state.pt (the optimizer's and scheduler's
    state and the RNGs) and state.json (`state`: step, data position, ..., and samples.jsonl's lines)."""
    tmp, final, old = (os.path.join(out, n) for n in ("checkpoint.tmp", "checkpoint", "checkpoint.old"))
    samples, lines = os.path.join(out, "samples.jsonl"), 0  # (a resume cuts samples.jsonl back to its lines)
    if os.path.exists(samples):
        with open(samples) as f:
            lines = sum(1 for _ in f)
    state = {**state, "samples_lines": lines}
    shutil.rmtree(tmp, ignore_errors=True)
    last = find_checkpoint(out)
    kept = f"the last checkpoint, {last}, is kept" if last else "no checkpoint was written"
    try:
        with hub.writing(tmp, kept=kept):
            os.makedirs(tmp)
            try:
                adapters.save_adapter(model, os.path.join(tmp, "adapter"))
            except hub.OutputError as e:  # (its line ends with what it kept of an adapter: say what the run keeps)
                raise hub.OutputError(f"{str(e).rsplit('; ', 1)[0]}; {kept}") from None
            rng, rng_meta = rng_state()
            # (through a buffer: torch.save's own file writer reports a full disk as a RuntimeError, where a plain
            # write raises the OSError that hub.writing turns into one line)
            buffer = io.BytesIO()
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng}, buffer)
            with open(os.path.join(tmp, "state.pt"), "wb") as f:
                f.write(buffer.getbuffer())
            hub.write_json(os.path.join(tmp, "state.json"), {**state, "rng": rng_meta})
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def find_checkpoint(out):
    """The newest checkpoint folder to resume from, or None: checkpoint/, else checkpoint.old/ (which
    is all there is after a crash between save_checkpoint's two renames)."""
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(out, name)
        if os.path.exists(os.path.join(path, "state.pt")):
            return path
    return None


STATE_NUMBERS = ("step", "data_pos", "samples_lines", "baseline_accuracy")  # what state.json must hold, each >= 0


def read_checkpoint(path, run_id=None):
    """(state.json merged with state.pt) of one checkpoint folder, checked whole: its state, its adapter,
    and that it belongs to the run `run_id` (args.json's). Raises ValueError naming the file otherwise.
    state.pt is read with weights_only=True: tensors and plain values only, so a crafted file cannot
    run code here; it is refused instead."""
    pt, js = os.path.join(path, "state.pt"), os.path.join(path, "state.json")
    try:
        tensors = torch.load(pt, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" in str(e).lower():  # torch refused a reference to code (GLOBAL), not a damaged file
            raise ValueError(f"{pt} holds objects other than tensors and plain values (pickled code, or a "
                             f"checkpoint of an older train.py), which --resume never loads") from None
        raise ValueError(f"{pt} is damaged or not a checkpoint (it does not unpickle)") from None
    except Exception as e:
        raise ValueError(f"{pt} is damaged or not a checkpoint ({type(e).__name__})") from None
    try:
        state = hub.read_json(js)
    except (OSError, ValueError) as e:
        raise ValueError(f"{js} is missing or damaged ({type(e).__name__}: {e})") from None
    if not isinstance(tensors, dict) or not {"optimizer", "scheduler", "rng"} <= set(tensors):
        raise ValueError(f"{pt} is not a train.py checkpoint (it lacks the optimizer, scheduler or RNG state)")
    if not isinstance(state, dict):
        raise ValueError(f"{js} is damaged: not the object a checkpoint writes (step, data_pos, ...)")
    bad = [k for k in STATE_NUMBERS if isinstance(state.get(k), bool) or not isinstance(state.get(k), (int, float))
           or not state[k] >= 0 or (k != "baseline_accuracy" and not isinstance(state[k], int))]
    if bad or not isinstance(state.get("run_id"), (str, type(None))):
        raise ValueError(f"{js} is damaged: {', '.join(bad) or 'run_id'} missing or not what a checkpoint writes "
                         f"(a count >= 0, an accuracy, a run id)")
    if state.get("run_id") != run_id:
        raise ValueError(f"{path} belongs to another run (its run id {state.get('run_id')} is not args.json's "
                         f"{run_id}); a run resumes only from checkpoints it wrote")
    adapters.read_adapter(os.path.join(path, "adapter"))  # (raises naming the file)
    return {**state, "json_rng": state.get("rng"), **tensors}


def load_checkpoint(out, run_id=None):
    """(path, state) of the newest readable checkpoint of the run in `out`: checkpoint/, or
    checkpoint.old/ when the newer one is damaged (said on stderr). Raises ValueError naming each file
    when there is none."""
    problems = []
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(out, name)
        if not os.path.exists(os.path.join(path, "state.pt")):
            continue
        try:
            state = read_checkpoint(path, run_id)
        except ValueError as e:
            problems.append(str(e))
            continue
        if problems:
            print(f"train.py: {problems[-1]}; resuming from the checkpoint before it, {path}", file=sys.stderr)
        return path, state
    if not problems:
        raise FileNotFoundError(f"--resume {out}: no checkpoint/ folder in it (still running, or stopped before its "
                                f"first checkpoint): nothing to resume; start it over with --out {out} --force "
                                f"(which deletes what it holds), or name a new --out")
    raise ValueError("cannot resume: " + "; ".join(problems) + ". Start the run again without --resume "
                     "(in a new --out, or with --force)")


def resume_point(out, run_id, steps, data):
    """(path, state) of the checkpoint a --resume continues from, after checking that nothing runs in the
    folder, that the run is not finished at `steps`, and that its --data file is the one it trained on."""
    if is_live(out):
        raise hub.OutputError(in_use(out))
    path, state = load_checkpoint(out, run_id)
    finished = summary_steps(out) == state["step"]  # (its own summary, not an extended run's shorter one)
    if state["step"] >= steps and (finished or state["step"] > steps):
        raise ValueError(f"--resume {out}: the run has done {state['step']} steps; pass a larger --steps with "
                         f"--resume to extend it")
    now = data_hash(data)
    if state.get("data_sha256", now) != now:
        raise ValueError(f"--data {data} changed since the run started (its content hash differs): resume with "
                         f"the file as it was, or start a new run")
    return path, state


def restore(checkpoint, model, optimizer, scheduler, out, args, main=True):
    """A resumed run's state from its checkpoint (path, state): the adapter and trained norms into `model`,
    the optimizer's and scheduler's state, every RNG; its logs cut back to the checkpoint's step (rank 0,
    `main`, alone writes), and a line that says so with the settings the run keeps (args) and what the
    command line changed. → (step, data position, baseline (accuracy, strict), the metrics rows so far)."""
    path, state = checkpoint
    adapters.load_adapter(model, os.path.join(path, "adapter"))
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"], state["json_rng"])
    rows, metrics = [], os.path.join(out, "metrics.jsonl")
    if main:
        truncate_jsonl(metrics, state["step"])
        truncate_jsonl(os.path.join(out, "samples.jsonl"), state["samples_lines"])
        with open(metrics) as f:
            rows = [json.loads(line) for line in f]
    baseline = state["baseline_accuracy"], state.get("baseline_accuracy_strict")
    changed = "; changed: " + ", ".join(f"--{k.replace('_', '-')} {a} -> {b}" for k, (a, b) in args.changed.items()) \
        if args.changed else ""
    print(f"resumed {out} at step {state['step']} from {path}, keeping its settings (args.json: recipe {args.recipe}, "
          f"model {args.model}, {args.quant}, {args.algo}, data {args.data}, seed {args.seed}){changed}")
    return state["step"], state["data_pos"], baseline, rows


def truncate_jsonl(path, keep):
    """Keep the first `keep` lines: a resumed run rewrites the steps after its checkpoint."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()[:keep]
    hub.write_text(path, "".join(lines))


def write_summary(out, summary):
    """summary.json of the run that ends now; a shorter run's, which this one extended, moves aside as
    summary.<its steps>-steps.json first (kept, never overwritten)."""
    path = os.path.join(out, "summary.json")
    earlier = summary_steps(out)
    if os.path.exists(path) and earlier != summary["steps"]:
        os.replace(path, os.path.join(out, f"summary.{earlier or 'unknown'}-steps.json"))
    with hub.writing(path, kept="the run's checkpoint, metrics and adapter are kept"):
        hub.write_json(path, summary)  # (a failed write leaves no partial file)


class WallTime:
    """The run's wall time over all its processes: OUT/wall_time.json lists each part's seconds (a run
    killed and resumed has several), this process's part updated as it goes."""

    def __init__(self, out, resume):
        self.path, self.t0 = os.path.join(out, "wall_time.json"), time.time()
        self.parts = []
        if resume and os.path.exists(self.path):
            try:
                parts = hub.read_json(self.path).get("parts_s", [])
                self.parts = [float(p) for p in parts]
            except (OSError, ValueError, AttributeError, TypeError):
                print(f"train.py: {self.path} is damaged; the wall time counts from this part", file=sys.stderr)
        self.parts.append(0.0)

    def update(self):
        self.parts[-1] = time.time() - self.t0
        hub.write_json(self.path, {"parts_s": self.parts})
        return sum(self.parts)


def check_finite(params, step, skipped, out):
    """Divergence stops the run, its last checkpoint kept (no later one is written): trainable parameters
    that hold NaN or infinity, or a loss or gradient non-finite three steps in a row (one such step is
    skipped, as a bad batch can be)."""
    bad = [i for i, p in enumerate(params) if not bool(torch.isfinite(p).all())]
    if bad or len(skipped) >= 3:
        why = (f"{len(bad)} trainable tensors hold NaN or infinity after step {step - 1}" if bad else
               f"the loss or gradient was non-finite at steps {', '.join(map(str, skipped[-3:]))}")
        last = find_checkpoint(out)
        raise SystemExit(f"train.py: the run diverged: {why}. "
                         + (f"Its last good checkpoint is {last}; " if last else "No checkpoint was written before; ")
                         + "start a new run with a lower --lr (or a smaller --grad-clip)")
