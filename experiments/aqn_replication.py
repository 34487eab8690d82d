"""experiments/aqn_replication.py: does quantization noise help exploration? A replication that could see it.

    python experiments/aqn_replication.py pilot --jobs 8 --time-limit 540       # choose the lr (pilot.json)
    python experiments/aqn_replication.py grid --jobs 12 --time-limit 540       # the arms x seeds; resumable
    python experiments/aqn_replication.py analyze                               # runs.csv, table.md, README
    python experiments/aqn_replication.py keep                                  # the raw records: runs.tar.gz
    python experiments/aqn_replication.py analyze --work results/aqn_replication/runs.tar.gz   # from them
    python experiments/aqn_replication.py grid --dry-run                        # the command lines only

The design, fixed before any run (results/aqn_replication/README.md says it in prose, with the commands).

The question. QeRL (arXiv 2510.11696) claims that the NVFP4 base's quantization error raises the
policy's entropy early in RL and so helps it explore, and that AQN (scheduled Gaussian noise on the
RMSNorm weights during rollout, aqn.py) helps further. The earlier test (results/aqn_experiment) could
not see such an effect: its noise never moved the policy and its task needed no search. Here the
policy is the Countdown policy (tiny.py --task countdown, assets/countdown: ~13 M parameters, stopped
at 10% pass@1), the task is countdown.py, and the noise is calibrated first (experiments/calibrate.py:
sigma* where AQN's KL equals the quantization's, tau* where bf16's entropy equals NVFP4's).

The arms (ARMS), DAPO, each a list of train.py flags on top of COMMON, paired on seed:
    1 bf16          bf16-LoRA, no noise                         --quant bf16 --no-aqn
    2 nvfp4         NVFP4-LoRA, no AQN                          --quant nvfp4 --no-aqn
    3 nvfp4-aqn     NVFP4 + AQN, the official sigmas            --quant nvfp4 --sigma-start 1e-2 --sigma-end 1e-4
    4 nvfp4-aqn*    NVFP4 + AQN from sigma* down 100x           --quant nvfp4 --sigma-start s* --sigma-end s*/100
    5 bf16-tau*     bf16 at tau* (entropy-matched control)      --quant bf16 --no-aqn --temperature tau*
    6 bf16-hot      bf16 hotter (positive control)              --quant bf16 --no-aqn --temperature tau_hot
    7, 8            arms 5 and 6 with the update scoring at T = 1   ... --train-temperature 1
    9 bf16-g16      bf16, 16 samples a prompt (positive control)    --quant bf16 --no-aqn --group-size 16
Arms 5 and 6 are the first and second grids' controls: TRL's trainer (and so train.py by default) scores the
sampled tokens at the sampling temperature, so the trained policy absorbs it. AQN's noise acts on the
sampler alone; arms 7 and 8 do the same with the temperature (the third grid's controls, --controls 7,8:
results/aqn_replication_2 says why). Arm 9 explores without changing what the policy samples from: more
samples a prompt (the fifth grid's positive control, --controls 7,9: results/aqn_replication_4 says why).
The grid runs arms 1-6 unless --arms names others.
{sigma_star}, {tau_star}, {tau_hot} come from calibration.json, {lr} from pilot.json (the pilot's rule
below). Every run logs its sigma; analyze drops (and names) a run whose logged noise contradicts its arm
(an AQN arm without noise, a no-noise arm with it), so a change of train.py's defaults cannot pass
silently.

The pilot (`pilot`): arm 1 at each of PILOT_LRS on PILOT_SEEDS (seeds the grid never uses), the full
run length. Rule: the largest lr whose sampler entropy (mean over the pilot seeds, 5-step moving
average) stays above COLLAPSE x its start (the mean of the first 3 steps) through the first third of
the steps; if none does, the smallest. AQN's 10 stages then last STEPS / 10 >= 10 steps each.

Each run (`grid`): `python experiments/aqn_replication.py tap RUN -- <train.py flags>` (train.py,
unchanged, under experiments/probe.py's read-only taps plus two here: which step each held-out probe
follows, and each probe problem's right count), then `python eval.py` on the saved adapter (FINAL_ITEMS
held-out problems x FINAL_SAMPLES samples at temperature 1), then `python experiments/calibrate.py
entropy` (teacher-forced entropy on the probe problems' reference solutions). Runs are independent
subprocesses, --jobs at a time, one CPU thread each (on one GPU with --device cuda in COMMON; --mps lets
their kernels share it side by side, mps(); a run that fails for want of GPU memory runs again after the
others, fewer at a time: run_all). A run whose folder holds done.json is skipped. An unfinished
training with a checkpoint (train.py writes one every --save-every steps: none in COMMON, where the runs
were short; --override='--save-every 10' for runs longer than a device call) continues from it with
train.py's --resume, and the taps cut their records back to the step it resumes at, so such a run finishes
over several calls on a machine that stays warm; one without a checkpoint starts again from scratch.
After a run its adapter, checkpoint and eval samples are deleted (per-problem counts kept), and pack()
leaves unfinished runs out, so what it packs stays small enough to carry between device calls; every
per-step record stays (run/metrics.jsonl, probe.jsonl, heldout.jsonl).
`keep` archives those records of every finished run (KEEP; small enough to commit, unlike the
folders) as results/aqn_replication/runs.tar.gz, and `analyze --work` on that archive recomputes pilot.json,
runs.csv, curves.json, table.md and the plots from it, without the run folders.

The analysis (`analyze`), fixed in advance. Per run (runs.csv): the primary metrics
    reward_area    the fraction of ALL sampled completions that were right (every DAPO round), averaged
                   over steps (probe.py): how fast reward came, in the arm's own sampling
    heldout_pass1  eval.py's pass@1 at temperature 1, FINAL_SAMPLES samples an item, no noise
and the secondary ones: pass@k (k = 2 ... FINAL_SAMPLES), first_solve (the mean over the probe problems
of the first held-out probe step at which one of its samples was right, censored one probe interval
after the end), solved_frac (probe problems ever solved), probe_area (held-out probe accuracy averaged
over the probes), tf_entropy (teacher-forced entropy at the end), sampler_entropy_early (mean -logp of
the sampled tokens over the first third of the steps) and mismatch_kl (train.py's sampler-trainer KL,
mean over steps). For each planned contrast (2-1, 4-1, 4-M, H-1 for the controls M, H: 4-5 and 6-1, or
4-7 and 8-1 with --controls 7,8) and metric: the paired differences over the seeds both arms finished,
their mean and 95% t-interval, and the two-sided sign-flip p (exact over all 2^n sign patterns up to 16
pairs, from 200,000 drawn beyond); for the primaries also the Holm-adjusted p over the four contrasts
(each primary its own family), the TOST equivalence p with margin MARGIN (two one-sided t-tests at 5%),
and the detectable difference (80% power, two-sided alpha / 4, the observed sd of the differences).
paired.png shows each contrast on the primaries seed by seed.
Note that reward_area is measured in each arm's own sampling: noise and a higher temperature lower it by
themselves, which works against arms 2-6; heldout_pass1 is measured alike for all.

The statement (statement()), computed from the table, never written by hand:
- the positive control works when H-1 (6-1) on heldout_pass1 is positive at Holm p < ALPHA;
- supports: it works, 2-1 or 4-1 is positive at Holm p < ALPHA on a primary, the sampler's early
  entropy is higher in that arm than in arm 1 (sign-flip p < ALPHA), and 4-M (4-5) is not significantly
  negative on either primary;
- refutes at this scale: it works and 2-1 and 4-1 are TOST-equivalent to zero on both primaries;
- inconclusive (positive control failed): it does not work, so this setting cannot show an
  exploration effect either way; otherwise inconclusive.
"""
import argparse
import contextlib
import csv
import glob
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from unittest import mock

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from experiments.aqn_grid import SIGN_FLIP_DRAWS, SIGN_FLIP_EXACT_MAX, Stop, fmt_ci, mean_ci, mean_of, num, \
    read_jsonl, run_cmd, sign_flip_p, t_cdf, t_quantile  # noqa: E402
import runs  # noqa: E402


@dataclass(frozen=True)
class Arm:
    number: int
    name: str
    label: str
    flags: tuple  # train.py flags; {sigma_star} {sigma_end} {tau_star} {tau_hot} filled from calibration.json
    noise: bool  # whether its runs must log an AQN sigma > 0


ARMS = (
    Arm(1, "bf16", "bf16-LoRA, no noise", ("--quant", "bf16", "--no-aqn"), False),
    Arm(2, "nvfp4", "NVFP4-LoRA, no AQN", ("--quant", "nvfp4", "--no-aqn"), False),
    Arm(3, "nvfp4-aqn", "NVFP4 + AQN, official sigmas", ("--quant", "nvfp4", "--sigma-start", "1e-2", "--sigma-end",
                                                         "1e-4"), True),
    Arm(4, "nvfp4-aqn-cal", "NVFP4 + AQN from sigma*", ("--quant", "nvfp4", "--sigma-start", "{sigma_star}",
                                                        "--sigma-end", "{sigma_end}"), True),
    Arm(5, "bf16-tau", "bf16 at tau* (entropy-matched)", ("--quant", "bf16", "--no-aqn", "--temperature", "{tau_star}"),
        False),
    Arm(6, "bf16-hot", "bf16 hotter (positive control)", ("--quant", "bf16", "--no-aqn", "--temperature", "{tau_hot}"),
        False),
    # The same two controls with the temperature on the sampler alone: the update scores at T = 1, as AQN's
    # noise acts on the rollout alone (the third grid's controls; results/aqn_replication_2 says why).
    Arm(7, "bf16-tau-sampler", "bf16 sampler at tau*, trainer at 1", ("--quant", "bf16", "--no-aqn", "--temperature",
                                                                       "{tau_star}", "--train-temperature", "1"), False),
    Arm(8, "bf16-hot-sampler", "bf16 sampler hotter, trainer at 1 (positive control)",
        ("--quant", "bf16", "--no-aqn", "--temperature", "{tau_hot}", "--train-temperature", "1"), False),
    # Exploration that does not touch the policy's distribution: twice the samples a prompt, so a group holds a
    # right answer more often (and the step sees twice the rollouts: compute is not matched). The fifth grid's
    # positive control (results/aqn_replication_4 says why); its flag comes after COMMON's, so it wins.
    Arm(9, "bf16-g16", "bf16, 16 samples a prompt (positive control: more discovery)",
        ("--quant", "bf16", "--no-aqn", "--group-size", "16"), False),
)
FIRST_ARMS = (1, 2, 3, 4, 5, 6)  # the grid's arms when --arms is not given (the first design's)
BASELINE = 1
STEPS = 100
# Every run's train.py flags besides its arm's (flag -> value; None for a switch). --override replaces
# any of them by name (the CPU smoke test swaps in the tiny model and the arith task).
COMMON = {
    "--model": "assets/countdown", "--data": "countdown", "--eval-data": "countdown", "--device": "cuda",
    "--algo": "dapo", "--steps": str(STEPS), "--prompts": "16", "--group-size": "8", "--max-new-tokens": "80",
    "--lr": "{lr}", "--warmup-steps": "5", "--min-lr-ratio": "0.1", "--lora-rank": "32", "--lora-alpha": "32",
    "--micro-batch": "128", "--reward": "strict", "--format-reward": "0", "--overlong-buffer": "0",
    "--aqn-stages": "10", "--eval-every": "20", "--eval-limit": "128", "--eval-samples": "4",
    "--eval-temperature": "1.0", "--eval-top-p": "1.0", "--eval-max-new-tokens": "80", "--save-every": "0",
    "--plot-every": "1000000", "--log-samples": "1", "--no-compile": None,
}
SEEDS = tuple(range(8))
FINAL_ITEMS, FINAL_SAMPLES = 512, 16
PILOT_LRS = (2e-4, 5e-4, 1e-3, 2e-3)
PILOT_SEEDS = (1000, 1001)
COLLAPSE = 0.5
CONTROLS = (5, 6)  # the entropy-matched and the positive control (--controls; 7,8 for the third grid)


def planned(controls=CONTROLS):
    """The four planned contrasts, given the (entropy-matched, positive) control arms: 2-1, 4-1, 4-m, h-1."""
    matched, hot = controls
    return ((2, 1), (4, 1), (4, matched), (hot, 1))


CONTRASTS = planned()
PRIMARY = ("reward_area", "heldout_pass1")
MARGIN = {"reward_area": 0.02, "heldout_pass1": 0.02}  # TOST: differences within +-2 points count as none
ALPHA = 0.05
SECONDARY = ("first_solve", "solved_frac", "probe_area", "tf_entropy", "sampler_entropy_early", "mismatch_kl")
LABELS = {"reward_area": "reward area", "heldout_pass1": "held-out pass@1", "first_solve": "first solve (step)",
          "solved_frac": "probe solved", "probe_area": "probe area", "tf_entropy": "H teacher-forced",
          "sampler_entropy_early": "H sampler, first third", "mismatch_kl": "sampler-trainer KL"}
TRAIN_DIR, EVAL_DIR = "run", "eval"


# ---------------------------------------------------------------------------------------------
# Statistics (numpy only; the t distribution and the sign-flip test are aqn_grid's)
# ---------------------------------------------------------------------------------------------

def holm(pvalues):
    """Holm's step-down adjusted p-values, in the input's order (NaN stays NaN and is not counted)."""
    idx = [i for i, p in enumerate(pvalues) if np.isfinite(p)]
    m, out, running = len(idx), [math.nan] * len(pvalues), 0.0
    for rank, i in enumerate(sorted(idx, key=lambda i: pvalues[i])):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        out[i] = running
    return out


def tost(d, margin):
    """The TOST p of equivalence: H0 |mean(d)| >= margin, two one-sided paired t-tests; p < alpha means the
    (1 - 2 alpha) t-interval lies inside (-margin, margin). NaN with fewer than 2 differences or sd 0."""
    d = np.asarray(d, dtype=float)
    if len(d) < 2 or d.std(ddof=1) == 0:
        return math.nan
    m, se, df = d.mean(), d.std(ddof=1) / math.sqrt(len(d)), len(d) - 1
    p_low = 1 - t_cdf((m + margin) / se, df)  # H0: mean <= -margin
    p_high = t_cdf((m - margin) / se, df)  # H0: mean >= margin
    return float(max(p_low, p_high))


def detectable(sd, n, alpha=ALPHA / len(CONTRASTS), power=0.8):
    """The smallest true mean difference a two-sided paired t-test at `alpha` detects with `power`, for
    differences of standard deviation sd over n pairs: (t_{1-alpha/2} + t_power) sd / sqrt(n)."""
    if n < 2 or not np.isfinite(sd):
        return math.nan
    return (t_quantile(1 - alpha / 2, n - 1) + t_quantile(power, n - 1)) * sd / math.sqrt(n)


def contrast(a, b, metric):
    """The paired comparison of arm rows a and b ({seed: row}) on a metric: n, mean, 95% t-interval,
    sign-flip p, TOST p (where the metric has a margin), the sd of the differences and the detectable
    difference."""
    seeds = sorted(s for s in a if s in b and np.isfinite(a[s][metric]) and np.isfinite(b[s][metric]))
    d = [a[s][metric] - b[s][metric] for s in seeds]
    m, lo, hi = mean_ci(d)
    sd = float(np.std(d, ddof=1)) if len(d) > 1 else math.nan
    return {"n": len(d), "mean": m, "lo": lo, "hi": hi, "p": sign_flip_p(d) if d else math.nan,
            "tost": tost(d, MARGIN[metric]) if metric in MARGIN else math.nan, "sd": sd,
            "detectable": detectable(sd, len(d)), "diffs": d, "seeds": seeds}


# ---------------------------------------------------------------------------------------------
# Command lines
# ---------------------------------------------------------------------------------------------

def parse_flags(text):
    """'--a 1 --b --c x' -> {"--a": "1", "--b": None, "--c": "x"} (a value is any token not starting with --)."""
    tokens, out, i = text.split(), {}, 0
    while i < len(tokens):
        if not tokens[i].startswith("--"):
            raise ValueError(f"--override: expected a flag at {tokens[i]!r} in {text!r}")
        has_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
        out[tokens[i]] = tokens[i + 1] if has_value else None
        i += 2 if has_value else 1
    return out


def flag_list(flags):
    return [t for k, v in flags.items() for t in ((k,) if v is None else (k, v))]


def common_flags(override="", lr=None):
    """COMMON with --override's flags replacing (or adding to) its own, and the lr when given."""
    flags = {**COMMON, **parse_flags(override)}
    if lr is not None:
        flags["--lr"] = f"{lr:g}"
    return flags


def arm_flags(arm, cal, placeholders=False):
    """The arm's flags with the calibrated values filled in (placeholders: left as they are without a
    calibration, for --dry-run)."""
    values = {} if cal is None else {"sigma_star": f"{cal['sigma_star']:.4g}", "sigma_end": f"{cal['sigma_star'] / 100:.4g}",
                                     "tau_star": f"{cal['tau_star']:.4g}", "tau_hot": f"{cal['tau_hot']:.4g}"}
    out = []
    for f in arm.flags:
        if "{" in f and not values:
            if placeholders:
                out.append(f)
                continue
            raise ValueError(f"arm {arm.number} ({arm.name}) needs calibration.json (run calibrate first): {f}")
        out.append(f.format(**values))
    return out


def quant_of(flags):
    return flags[flags.index("--quant") + 1]


@dataclass
class Job:
    name: str
    arm: object  # Arm, or None in the pilot
    seed: int
    lr: float
    run_dir: str
    stages: list  # [(name, command)] in order; "train" first


def task_name(flags):
    data = flags["--eval-data"]
    from data import GENERATED

    if data not in GENERATED:
        raise ValueError(f"--eval-data {data}: the replication's probes and teacher-forced entropy need a generated "
                         f"set ({', '.join(GENERATED)})")
    return data


def make_job(name, arm, seed, lr, train_flags, common, work, final=True, final_items=FINAL_ITEMS,
             final_samples=FINAL_SAMPLES):
    """One run: the tapped train.py, then (final) eval.py and the teacher-forced entropy on its adapter."""
    run = os.path.join(work, name)
    adapter = os.path.join(run, TRAIN_DIR, "adapter")
    stages = [("train", [sys.executable, "experiments/aqn_replication.py", "tap", run, "--", *train_flags,
                         "--seed", str(seed), "--out", os.path.join(run, TRAIN_DIR)])]
    if final:
        quant = quant_of(train_flags)
        stages.append(("eval", [sys.executable, "eval.py", "--model", common["--model"], "--adapter", adapter,
                                "--quant", quant, "--data", common["--eval-data"], "--limit", str(final_items),
                                "--samples", str(final_samples), "--temperature", "1.0", "--top-p", "1.0",
                                "--max-new-tokens", common["--max-new-tokens"], "--device", common["--device"],
                                "--seed", str(seed), "--batch-size", "2048", "--out", os.path.join(run, EVAL_DIR)]))
        stages.append(("entropy", [sys.executable, "experiments/calibrate.py", "entropy", "--model", common["--model"],
                                   "--adapter", adapter, "--quant", quant, "--data", task_name(common),
                                   "--prompts", common["--eval-limit"], "--device", common["--device"],
                                   "--max-new-tokens", common["--max-new-tokens"],
                                   "--out", os.path.join(run, "tf_entropy.json")]))
    return Job(name, arm, seed, lr, run, stages)


def grid_jobs(work, cal, lr, override="", seeds=SEEDS, arms=None, final_items=FINAL_ITEMS, final_samples=FINAL_SAMPLES,
              placeholders=False):
    """Every (arm, seed) of the grid, seed by seed (a grid cut short holds whole pairs for its first seeds)."""
    common = common_flags(override, lr)
    jobs = []
    for seed in seeds:
        for arm in arms or [a for a in ARMS if a.number in FIRST_ARMS]:
            flags = flag_list(common) + arm_flags(arm, cal, placeholders)
            jobs.append(make_job(f"{arm.number}-{arm.name}-s{seed}", arm, seed, lr, flags, common, work,
                                 final_items=final_items, final_samples=final_samples))
    return jobs


def pilot_jobs(work, override="", lrs=PILOT_LRS, seeds=PILOT_SEEDS):
    """Arm 1 at every pilot lr and seed: training only."""
    jobs = []
    for lr in lrs:
        common = common_flags(override, lr)
        for seed in seeds:
            flags = flag_list(common) + arm_flags(ARMS[0], None)
            jobs.append(make_job(f"pilot-lr{lr:g}-s{seed}", ARMS[0], seed, lr, flags, common, work, final=False))
    return jobs


# ---------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------

def done(run_dir):
    return os.path.exists(os.path.join(run_dir, "done.json"))


def stage_done(job, stage):
    path = {"train": os.path.join(TRAIN_DIR, "summary.json"), "eval": os.path.join(EVAL_DIR, "summary.json"),
            "entropy": "tf_entropy.json"}[stage]
    return os.path.exists(os.path.join(job.run_dir, path))


def finish(job, keep_adapters=False):
    """After the last stage: per-problem right counts from eval.py's samples, then the bulky files removed
    (adapter, checkpoints, samples, train.py's own plot, which no analysis reads), and done.json written."""
    eval_dir = os.path.join(job.run_dir, EVAL_DIR)
    samples = os.path.join(eval_dir, "samples.jsonl")
    if os.path.exists(samples):
        counts = {}
        for r in read_jsonl(samples):
            counts[r["index"]] = counts.get(r["index"], 0) + int(r["correct"])
        with open(os.path.join(eval_dir, "per_item.json"), "w") as f:
            json.dump([counts.get(i, 0) for i in range(max(counts) + 1)] if counts else [], f)
        os.remove(samples)
    train_dir = os.path.join(job.run_dir, TRAIN_DIR)
    if not keep_adapters and os.path.isdir(train_dir):
        for name in os.listdir(train_dir):
            if name == "adapter" or name.startswith("checkpoint"):
                shutil.rmtree(os.path.join(train_dir, name), ignore_errors=True)
        if os.path.exists(os.path.join(train_dir, "curves.png")):
            os.remove(os.path.join(train_dir, "curves.png"))
    with open(os.path.join(job.run_dir, "done.json"), "w") as f:
        json.dump({"stages": [s for s, _ in job.stages], "seed": job.seed, "lr": job.lr}, f)


# what a stage's log ends with when the GPU ran out of memory: a run among too many sharing one card
OUT_OF_MEMORY = ("CUDA out of memory", "CUBLAS_STATUS_ALLOC_FAILED", "CUDA_ERROR_OUT_OF_MEMORY",
                 "CUDA error: out of memory")


def ran_out_of_memory(log, tail_bytes=8192):
    """Whether a failed stage's log ends in the GPU running out of memory (not a fault of the run's own)."""
    try:
        with open(log, "rb") as f:
            f.seek(max(0, os.path.getsize(log) - tail_bytes))
            tail = f.read().decode(errors="replace")
    except OSError:
        return False
    return any(s in tail for s in OUT_OF_MEMORY)


def run_job(job, stop, procs, keep_adapters=False, late=lambda: False):
    """Run the job's stages not done yet (an unfinished training continues from its checkpoint, or starts
    again from scratch without one); no training starts once late() (too close to the deadline to finish).
    Returns (a status line, whether a stage failed for want of GPU memory)."""
    if done(job.run_dir):
        return "already done", False
    t0 = time.time()
    for stage, cmd in job.stages:
        if stage_done(job, stage):
            continue
        if stop() or (stage == "train" and late()):
            return "not started (stopped)", False
        log = os.path.join(job.run_dir, f"{stage}.log")
        if stage == "train" and runs.find_checkpoint(os.path.join(job.run_dir, TRAIN_DIR)):
            cmd = [*cmd, "--resume", os.path.join(job.run_dir, TRAIN_DIR)]
            log = os.path.join(job.run_dir, f"{stage}.resumed-{len(glob.glob(log[:-4] + '.resumed-*')) + 1}.log")
        elif stage == "train":
            shutil.rmtree(job.run_dir, ignore_errors=True)
            os.makedirs(job.run_dir)
        rc = run_cmd(cmd, log, stop, procs)
        if rc is None:
            return f"{stage} killed (stopped): see {log}", False
        if rc != 0:
            oom = ran_out_of_memory(log)
            return f"{stage} FAILED rc={rc}{' (out of GPU memory)' if oom else ''}: see {log}", oom
    finish(job, keep_adapters)
    return f"done in {time.time() - t0:.0f} s", False


def run_all(jobs, n_jobs, deadline, keep_adapters=False, min_run_s=0.0):
    """Run the jobs not done, n_jobs at a time; at the deadline the running ones are killed (the next call
    continues them: run_job), and no run starts in the last min_run_s seconds before it. Runs that fail for
    want of GPU memory (too many sharing the card) run again once the others are through, half as many
    at a time, until one at a time."""
    todo = [j for j in jobs if not done(j.run_dir)]
    print(f"{len(jobs)} runs, {len(jobs) - len(todo)} already done, {len(todo)} to run, {n_jobs} at a time", flush=True)
    stop, procs = Stop(deadline), set()
    late = Stop(None if deadline is None else deadline - min_run_s)
    while todo:
        again = []
        with ThreadPoolExecutor(max_workers=n_jobs) as pool:
            futures = {pool.submit(run_job, j, stop, procs, keep_adapters, late): j for j in todo}
            try:
                for i, fut in enumerate(as_completed(futures)):
                    line, out_of_memory = fut.result()
                    print(f"[{i + 1}/{len(todo)}] {futures[fut].name}: {line}", flush=True)
                    if out_of_memory:
                        again.append(futures[fut])
            except KeyboardInterrupt:  # the runs are in their own process groups: Ctrl-C reaches only us
                stop.event.set()
                print("stopping: killing the running runs (the next call continues them)", flush=True)
                raise
        if not again or n_jobs == 1 or stop():
            return
        n_jobs = max(1, n_jobs // 2)
        print(f"{len(again)} run(s) ran out of GPU memory: running them again, {n_jobs} at a time", flush=True)
        todo = sorted(again, key=jobs.index)


@contextlib.contextmanager
def mps(enabled):
    """With `enabled`, CUDA's Multi-Process Service for the runs. Without it the GPU time-slices between the
    runs' processes, one process's kernels at a time, and the small kernels of a 13 M-parameter policy fill
    little of it; with it the processes' kernels run side by side (about twice the runs an hour on an H100:
    results/aqn_replication_2). The daemon runs from a temporary folder and quits on the way out; where it
    cannot start, or a client cannot use it, the runs share the GPU as before, and this says so. Yields
    whether it is on."""
    exe = shutil.which("nvidia-cuda-mps-control") if enabled else None
    if not enabled or exe is None:
        if enabled:
            print("--mps: nvidia-cuda-mps-control not found; the runs time-slice the GPU", flush=True)
        yield False
        return
    tmp = tempfile.mkdtemp(prefix="qerl-mps-")
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(tmp, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(tmp, "log")}
    for d in env.values():
        os.makedirs(d)
    with_env = dict(os.environ, **env)

    def quit_daemon():
        subprocess.run([exe], input="quit\n", env=with_env, text=True, capture_output=True)

    started = subprocess.run([exe, "-d"], env=with_env, capture_output=True, text=True).returncode == 0
    try:
        client = started and subprocess.run([sys.executable, "-c", "import torch; torch.ones(8, device='cuda').sum()"
                                             ".item()"], env=with_env, capture_output=True, timeout=300).returncode == 0
    except subprocess.TimeoutExpired:
        client = False
    if started and not client:
        quit_daemon()
    if not client:
        print(f"--mps: the daemon {'started but a CUDA client failed' if started else 'did not start'}; the runs "
              f"time-slice the GPU", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)
        yield False
        return
    print(f"--mps: CUDA MPS on ({tmp})", flush=True)
    try:  # (the runs' subprocesses inherit the environment: aqn_grid.job_env copies os.environ)
        with mock.patch.dict(os.environ, env):
            yield True
    finally:
        quit_daemon()
        shutil.rmtree(tmp, ignore_errors=True)


def missing_flags(jobs):
    """train.py flags the jobs use that `python train.py --help` does not list (aqn_grid's check, on our jobs)."""
    from experiments import aqn_grid

    return aqn_grid.missing_flags([argparse.Namespace(train_cmd=j.stages[0][1][1:]) for j in jobs])


# ---------------------------------------------------------------------------------------------
# The tapped training run
# ---------------------------------------------------------------------------------------------

def tap(argv):
    """`tap RUN -- <train.py flags>`: train.py under experiments/probe.py's taps (RUN/probe.jsonl: every
    step's sampled accuracy and sampler entropy), plus two: the index of the step train.py is on
    (logs.step_metrics) and each held-out evaluation's right count per problem (eval.evaluate, which
    eval.heldout calls; these runs are single-process, so its records index the whole held-out set), written
    as RUN/heldout.jsonl lines {"after_steps", "samples", "correct"}: the baseline after 0 steps, the
    probes after every --eval-every steps, the final one after --steps. With --resume among the flags the
    file is kept, cut back to the evaluations up to the step the run resumes at (those after it come again)."""
    from experiments import probe
    import eval as ev
    import logs

    run_dir, train_argv = argv[0], argv[1:]
    if train_argv[:1] == ["--"]:
        train_argv = train_argv[1:]
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, "heldout.jsonl")
    probe.start_records(path, train_argv)
    state = {"step": None}
    real_step_metrics, real_evaluate, real_restore = logs.step_metrics, ev.evaluate, runs.restore

    def restore(*a, **k):
        resumed = real_restore(*a, **k)  # (step, ...): the steps done
        runs.truncate_jsonl(path, sum(h["after_steps"] <= resumed[0] for h in read_jsonl(path)))
        return resumed

    def step_metrics(step, *a, **k):
        state["step"] = step
        return real_step_metrics(step, *a, **k)

    def evaluate(model, tokenizer, items, *a, **k):
        res = real_evaluate(model, tokenizer, items, *a, **k)
        correct = [0] * len(items)
        for r in res["records"]:
            correct[r["index"]] += int(r["correct"])
        with open(path, "a") as f:
            f.write(json.dumps({"after_steps": 0 if state["step"] is None else state["step"] + 1,
                                "samples": res["samples"], "correct": correct}) + "\n")
        return res

    logs.step_metrics, ev.evaluate, runs.restore = step_metrics, evaluate, restore
    summary = probe.main([os.path.join(run_dir, "probe.jsonl"), "--", *train_argv])
    if not read_jsonl(path):
        sys.exit(f"aqn_replication.py: no held-out evaluation reached the tap ({path}): train.py no longer calls "
                 f"eval.evaluate or logs.step_metrics through their modules; update tap()")
    return summary


# ---------------------------------------------------------------------------------------------
# Collecting a run
# ---------------------------------------------------------------------------------------------

def first_solves(heldout, steps):
    """Per probe problem, the first held-out evaluation (after_steps) with a right sample; never solved:
    one probe interval past the end (censored)."""
    after = [h["after_steps"] for h in heldout]
    interval = after[1] - after[0] if len(after) > 1 else max(steps, 1)
    n = len(heldout[0]["correct"])
    first = [next((h["after_steps"] for h in heldout if h["correct"][i] > 0), None) for i in range(n)]
    return [steps + interval if f is None else f for f in first], sum(f is not None for f in first) / n


def collect_run(run_dir):
    """(row, curves) of a finished run (done.json), or None."""
    if not done(run_dir):
        return None
    train_dir = os.path.join(run_dir, TRAIN_DIR)
    with open(os.path.join(train_dir, "summary.json")) as f:
        summary = json.load(f)
    metrics = read_jsonl(os.path.join(train_dir, "metrics.jsonl"))
    probe = {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "probe.jsonl"))}
    heldout = read_jsonl(os.path.join(run_dir, "heldout.jsonl"))
    steps = [m["step"] for m in metrics]
    n_steps = len(steps)
    third = max(1, math.ceil(n_steps / 3))
    reward = [probe.get(s, {}).get("sampled_accuracy") for s in steps]
    h_sampler = [probe.get(s, {}).get("sampler_entropy") for s in steps]
    first, solved = first_solves(heldout, n_steps)
    probe_acc = [sum(h["correct"]) / (len(h["correct"]) * h["samples"]) for h in heldout]
    row = {"reward_area": mean_of(reward), "sampler_entropy_0": h_sampler[0] if h_sampler else math.nan,
           "sampler_entropy_early": mean_of(h_sampler[:third]),
           "trainer_entropy_early": mean_of([m.get("entropy") for m in metrics[:third]]),
           "mismatch_kl": mean_of([m.get("mismatch_kl") for m in metrics]),
           "first_solve": float(np.mean(first)), "solved_frac": solved, "probe_area": float(np.mean(probe_acc)),
           "baseline_accuracy": summary.get("baseline_accuracy", math.nan),
           "final_accuracy": summary.get("final_accuracy", math.nan),
           "max_sigma": max((m.get("sigma") or 0.0) for m in metrics) if metrics else 0.0, "steps": n_steps,
           "step_s": mean_of([m.get("time_step") for m in metrics]), "wall_s": summary.get("wall_time_s", math.nan)}
    eval_summary = os.path.join(run_dir, EVAL_DIR, "summary.json")
    if os.path.exists(eval_summary):
        with open(eval_summary) as f:
            ev = json.load(f)
        row["heldout_pass1"] = ev["accuracy"]
        row.update({f"pass@{k}": v for k, v in sorted(ev["pass@k"].items(), key=lambda kv: int(kv[0])) if int(k) > 1})
        row["eval_s"] = ev.get("seconds", math.nan)
    tf = os.path.join(run_dir, "tf_entropy.json")
    if os.path.exists(tf):
        with open(tf) as f:
            row["tf_entropy"] = json.load(f)["tf_entropy"]
    curves = {"step": steps, "reward": reward, "sampler_entropy": h_sampler,
              "trainer_entropy": [m.get("entropy") for m in metrics], "sigma": [m.get("sigma") for m in metrics],
              "mismatch_kl": [m.get("mismatch_kl") for m in metrics],
              "probe_step": [h["after_steps"] for h in heldout], "probe_accuracy": probe_acc}
    return row, curves


def collect(jobs):
    """(rows, curves, dropped): finished runs; those whose logged noise contradicts their arm are dropped."""
    rows, curves, dropped = [], {}, []
    for j in jobs:
        got = collect_run(j.run_dir)
        if got is None:
            continue
        row, c = got
        if (row["max_sigma"] > 0) != j.arm.noise:
            dropped.append(f"{j.name}: logged max sigma {row['max_sigma']:g}, but arm {j.arm.number} is "
                           f"{'with' if j.arm.noise else 'without'} AQN")
            continue
        rows.append({"arm": j.arm.number, "arm_name": j.arm.name, "seed": j.seed, "lr": j.lr, **row})
        curves[f"{j.arm.number}/{j.seed}"] = c
    return rows, curves, dropped


# ---------------------------------------------------------------------------------------------
# The pilot's rule
# ---------------------------------------------------------------------------------------------

def moving_average(x, w=5):
    x = np.asarray(x, dtype=float)
    return np.array([np.nanmean(x[max(0, i - w + 1):i + 1]) for i in range(len(x))])


def collapse_step(entropy, fraction=COLLAPSE):
    """The first step whose 5-step moving average of the sampler entropy is below `fraction` x its start
    (the mean of the first 3 steps), or None."""
    e = moving_average(entropy)
    start = float(np.nanmean(np.asarray(entropy[:3], dtype=float)))
    below = np.nonzero(e < fraction * start)[0]
    return int(below[0]) if len(below) else None


def choose_lr(curves_by_lr, steps):
    """The pilot's rule: {lr: [sampler entropy curves of its seeds]} -> (lr, {lr: collapse step}). The
    largest lr whose seed-mean curve does not collapse within the first third of the steps; else the
    smallest lr."""
    collapse = {}
    for lr, cs in curves_by_lr.items():
        length = min(len(c) for c in cs)
        mean = np.nanmean(np.array([[np.nan if v is None else v for v in c[:length]] for c in cs], dtype=float), axis=0)
        collapse[lr] = collapse_step(mean)
    ok = [lr for lr, c in collapse.items() if c is None or c >= steps / 3]
    return (max(ok) if ok else min(collapse)), collapse


# ---------------------------------------------------------------------------------------------
# Aggregation, the table and the statement
# ---------------------------------------------------------------------------------------------

def by_arm(rows):
    out = {}
    for r in rows:
        out.setdefault(r["arm"], {})[r["seed"]] = r
    return out


def metric_keys(rows):
    """The primaries, eval.py's pass@k (k > 1) and the other secondaries, as far as the rows have them."""
    passes = sorted({k for r in rows for k in r if k.startswith("pass@")}, key=lambda k: int(k[5:]))
    return [k for k in PRIMARY + tuple(passes) + SECONDARY if any(k in r for r in rows)]


def analyze(rows, controls=CONTROLS):
    """{"arms": {arm: {"n", metric: (mean, lo, hi)}}, "contrasts": {(a, b): {metric: contrast}}, "controls"}
    with Holm's p over the planned contrasts (planned(controls)) for each primary metric ("holm")."""
    arms, keys, contrasts = by_arm(rows), metric_keys(rows), planned(controls)
    nan_row = lambda r: {k: r.get(k, math.nan) for k in keys}  # noqa: E731
    out = {"arms": {}, "contrasts": {}, "controls": tuple(controls)}
    for a, seeds in arms.items():
        out["arms"][a] = {"n": len(seeds), **{k: mean_ci([r.get(k, math.nan) for r in seeds.values()]) for k in keys}}
    for a, b in contrasts:
        if a in arms and b in arms:
            A = {s: nan_row(r) for s, r in arms[a].items()}
            B = {s: nan_row(r) for s, r in arms[b].items()}
            out["contrasts"][(a, b)] = {k: contrast(A, B, k) for k in keys}
    for k in PRIMARY:
        pairs = [c for c in contrasts if c in out["contrasts"] and k in out["contrasts"][c]]
        for c, p in zip(pairs, holm([out["contrasts"][c][k]["p"] for c in pairs])):
            out["contrasts"][c][k]["holm"] = p
    return out


def wins(res, c, k):
    x = res["contrasts"].get(c, {}).get(k)
    return bool(x and x["n"] >= 2 and x["mean"] > 0 and x.get("holm", 1.0) < ALPHA)


def loses(res, c, k):
    x = res["contrasts"].get(c, {}).get(k)
    return bool(x and x["n"] >= 2 and x["mean"] < 0 and x.get("holm", 1.0) < ALPHA)


def equivalent(res, c, k):
    x = res["contrasts"].get(c, {}).get(k)
    return bool(x and x["tost"] < ALPHA)


def entropy_up(res, c):
    x = res["contrasts"].get(c, {}).get("sampler_entropy_early")
    return bool(x and x["n"] >= 2 and x["mean"] > 0 and x["p"] < ALPHA)


def statement(res):
    """(verdict, reasons): the rule of the module docstring applied to the analysis."""
    matched, hot = res["controls"]
    positive = wins(res, (hot, 1), "heldout_pass1")
    helped = [a for a in (2, 4) if any(wins(res, (a, 1), k) for k in PRIMARY)]
    up = [a for a in helped if entropy_up(res, (a, 1))]
    four_ok = not any(loses(res, (4, matched), k) for k in PRIMARY)
    null = all(equivalent(res, (a, 1), k) for a in (2, 4) for k in PRIMARY)
    reasons = [f"positive control ({hot}-1 on held-out pass@1, Holm p < {ALPHA}): {'works' if positive else 'fails'}",
               f"arms beating bf16-LoRA on a primary after Holm: {', '.join(map(str, helped)) or 'none'}",
               f"of those, with higher early sampler entropy (sign-flip p < {ALPHA}): {', '.join(map(str, up)) or 'none'}",
               f"4-{matched} not significantly negative on either primary: {'yes' if four_ok else 'no'}",
               f"2-1 and 4-1 TOST-equivalent to zero on both primaries (margins {MARGIN}): {'yes' if null else 'no'}"]
    if not positive:
        verdict = "inconclusive (positive control failed)"
    elif up and four_ok:
        verdict = "supports"
    elif null:
        verdict = "refutes at this scale"
    else:
        verdict = "inconclusive"
    return verdict, reasons


def fmt_p(p):
    return "–" if not np.isfinite(p) else f"{p:.3g}"


def table_md(res, settings, dropped):
    arm_by = {a.number: a for a in ARMS}
    keys = [k for k in next(iter(res["arms"].values()), {}) if k != "n"]
    head = "| arm | n | " + " | ".join(LABELS.get(k, k) for k in keys) + " |"
    sep = "|" + "---|" * (len(keys) + 2)
    lines = ["# Does quantization noise help exploration? (experiments/aqn_replication.py)", "", f"Settings: {settings}", "",
             "Mean over seeds [95% t-interval]. Entropies in nats a token; KL in nats a token; first solve in steps.", "",
             head, sep]
    for a in sorted(res["arms"]):
        e = res["arms"][a]
        lines.append(f"| {a} {arm_by[a].label} | {e['n']} | " + " | ".join(fmt_ci(*e[k]) for k in keys) + " |")
    pairs = max((c["n"] for cs in res["contrasts"].values() for c in cs.values()), default=0)
    exact = pairs <= SIGN_FLIP_EXACT_MAX  # (sign_flip_p's rule)
    lines += ["", "## Planned contrasts (paired on seed)", "",
              f"Each cell: mean difference [95% t-interval], {'exact ' if exact else ''}sign-flip p; primaries also "
              f"Holm-adjusted p over the four contrasts (each primary its own family), TOST p (margins {MARGIN}) and the "
              f"difference detectable with 80% power at alpha {ALPHA}/{len(CONTRASTS)} given the observed spread. "
              + ("The smallest sign-flip p with n pairs is 2/2^n." if exact else
                 f"With more than {SIGN_FLIP_EXACT_MAX} pairs the sign-flip p is estimated from {SIGN_FLIP_DRAWS:,} "
                 f"random sign patterns, so the smallest it can show is {1 / (SIGN_FLIP_DRAWS + 1):.0e}."), "",
              "| contrast | pairs | " + " | ".join(LABELS.get(k, k) for k in keys) + " |", sep]
    for (a, b), cs in res["contrasts"].items():
        cells = []
        for k in keys:
            c = cs[k]
            if not c["n"]:
                cells.append("–")
                continue
            cell = f"{num(c['mean'], '+')} [{num(c['lo'], '+')}, {num(c['hi'], '+')}] p={fmt_p(c['p'])}" \
                if np.isfinite(c["lo"]) else f"{num(c['mean'], '+')} (n=1)"
            if k in PRIMARY:
                cell += f", Holm {fmt_p(c.get('holm', math.nan))}, TOST {fmt_p(c['tost'])}, detectable " \
                        f"{num(c['detectable']) if np.isfinite(c['detectable']) else '–'}"
            cells.append(cell)
        n = max(c["n"] for c in cs.values())
        lines.append(f"| {a}-{b} | {n} | " + " | ".join(cells) + " |")
    verdict, reasons = statement(res)
    lines += ["", f"## Statement: **{verdict}**", ""] + [f"- {r}" for r in reasons]
    if dropped:
        lines += ["", "Runs dropped because their logged noise contradicts their arm:"] + [f"- {d}" for d in dropped]
    return "\n".join(lines) + "\n"


def band(values):
    arr = np.array([[np.nan if v is None else v for v in c] for c in values], dtype=float)  # (runs, points)
    return tuple(np.array(s) for s in zip(*[mean_ci(arr[:, i]) for i in range(arr.shape[1])]))


def plot(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (("step", "reward", "fraction of sampled completions right"),
              ("step", "sampler_entropy", "sampler entropy (nats/token)"),
              ("probe_step", "probe_accuracy", "held-out probe accuracy (T=1, no noise)"),
              ("step", "mismatch_kl", "sampler-trainer KL (nats/token)"))
    fig, axes = plt.subplots(2, 2, figsize=(13, 8), squeeze=False)
    for ax, (xkey, key, ylabel) in zip(axes.flat, panels):
        for arm in ARMS:
            runs = [c for k, c in curves.items() if k.split("/")[0] == str(arm.number)]
            if not runs:
                continue
            length = min(len(c[key]) for c in runs)
            m, lo, hi = band([c[key][:length] for c in runs])
            x = runs[0][xkey][:length]
            ax.plot(x, m, label=f"{arm.number} {arm.label} (n={len(runs)})")
            if len(runs) > 1:
                ax.fill_between(x, lo, hi, alpha=0.15)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle("mean and 95% interval over seeds")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_paired(res, path):
    """The planned contrasts on the two primaries, seed by seed: each dot one seed's paired difference
    (its seed number beside it), the square the mean with its 95% t-interval, the dashed lines TOST's margins.
    A seed far from the others is visible here where the table shows only a wide interval."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PRIMARY), figsize=(6 * len(PRIMARY), 4.5), squeeze=False)
    for ax, k in zip(axes.flat, PRIMARY):
        names = []
        for i, c in enumerate(c for c, cs in res["contrasts"].items() if k in cs):  # (analyze's order: planned)
            x = res["contrasts"][c][k]
            names.append(f"{c[0]}-{c[1]}")
            offsets = np.linspace(-0.15, 0.15, max(len(x["diffs"]), 1))
            ax.scatter(i + offsets, x["diffs"], s=14, color="tab:blue", zorder=3)
            for dx, d, seed in zip(offsets, x["diffs"], x["seeds"]):
                ax.annotate(str(seed), (i + dx, d), xytext=(3, 0), textcoords="offset points", fontsize=6,
                            va="center")
            if np.isfinite(x["lo"]):
                ax.errorbar(i + 0.3, x["mean"], yerr=[[x["mean"] - x["lo"]], [x["hi"] - x["mean"]]], fmt="s",
                            color="black", capsize=4, zorder=4)
        ax.axhline(0, color="gray", lw=0.8)
        for m in (-MARGIN[k], MARGIN[k]):
            ax.axhline(m, color="gray", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), names)
        ax.set_xlabel("contrast (arm minus arm, same seed)")
        ax.set_ylabel(f"{LABELS.get(k, k)} difference")
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("paired differences: dots are seeds, the square the mean with its 95% t-interval; dashed: "
                 "TOST margins", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def write_rows(path, rows):
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def fill_readme(path, sections):
    """Replace the text between `<!-- BEGIN name -->` and `<!-- END name -->` in the README by each section's
    new text (the README's design text stays as written)."""
    with open(path) as f:
        text = f.read()
    for name, body in sections.items():
        begin, end = f"<!-- BEGIN {name} -->", f"<!-- END {name} -->"
        if begin not in text or end not in text:
            raise ValueError(f"{path} has no {begin} ... {end} block to fill")
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + body.strip() + "\n" + end + rest.split(end, 1)[1]
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def calibration_md(cal, rows):
    we = cal["weight_error"]
    lines = [f"On {cal['prompts']} held-out prompts ({cal['completion_tokens']} completion tokens, sampled once by "
             f"the bf16 policy at temperature 1; {cal['device']}):", "",
             f"- NVFP4 vs bf16: KL {cal['kl_nvfp4']:.3e} nats a token; entropy {cal['entropy_bf16']:.4f} -> "
             f"{cal['entropy_nvfp4']:.4f} nats a token ({cal['entropy_nvfp4'] - cal['entropy_bf16']:+.4f}).",
             f"- Relative weight error of NVFP4 over the decoder linears: {we['all']:.4f} ("
             + ", ".join(f"{k} {v:.4f}" for k, v in we.items() if k != "all")
             + f"); on a random matrix of a 7B projection's shape: {cal['weight_error_random_7b_shape']:.4f}.",
             f"- RMSNorm weights: mean |w| {cal['norm_weights']['mean_abs']:.3f}, smallest {cal['norm_weights']['min_abs']:.3f}.",
             f"- AQN on the bf16 base at sigma 1e-2: KL {cal['kl_aqn_bf16_at_1e-2']:.3e} nats a token (the design "
             f"section gives the 7B-shape figure)." if cal.get("kl_aqn_bf16_at_1e-2") is not None else None,
             f"- sigma* = {cal['sigma_star']:.4g}{'' if cal['sigma_star_in_grid'] else ' (extrapolated beyond the grid)'}"
             f" (AQN's KL there, measured: {cal['kl_at_sigma_star']:.3e}); tau* = {cal['tau_star']:.4f}; "
             f"tau_hot = {cal['tau_hot']:.4f}.", "",
             "| source | sigma or tau | KL (nats/token) | entropy | entropy change |", "| --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['source']} | {r['parameter']} | {float(r['kl']):.3e} | {float(r['entropy']):.4f} | "
                     f"{float(r['entropy_change']):+.4f} |")
    return "\n".join(line for line in lines if line is not None)


def pilot_md(pilot):
    lines = [f"Chosen lr: **{pilot['lr']:g}** (rule: the largest lr whose mean sampler entropy stays above "
             f"{COLLAPSE:g} x its start through the first third of {pilot['steps']} steps; seeds {pilot['seeds']}).", "",
             "| lr | collapse step | reward area | mean step (s) | mean run, training (s) |",
             "| --- | --- | --- | --- | --- |"]
    for lr, v in pilot["per_lr"].items():
        lines.append(f"| {lr} | {v['collapse_step'] if v['collapse_step'] is not None else 'none'} | "
                     f"{v['reward_area']:.3f} | {v['step_s']:.2f} | {v['run_s']:.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Keeping every run's raw records in the repository
# ---------------------------------------------------------------------------------------------

# What a finished run folder holds that the analysis reads (collect_run, write_pilot), plus the two small
# files a reader wants beside them (train.py's args.json: the run's full settings; eval.py's per-problem
# right counts). The logs, train.py's plot and its few sample texts are left out.
KEEP = ("done.json", "probe.jsonl", "heldout.jsonl", "tf_entropy.json", f"{TRAIN_DIR}/metrics.jsonl",
        f"{TRAIN_DIR}/summary.json", f"{TRAIN_DIR}/args.json", f"{EVAL_DIR}/summary.json", f"{EVAL_DIR}/per_item.json")


def keep(work, path):
    """Write `path` (a .tar.gz): KEEP's files of every finished run folder in `work`, as RUN/FILE. Byte for
    byte the same from the same records (sorted members, no times or owners), so a rewrite shows in git only
    when a record changed. Returns the number of runs kept."""
    import gzip

    runs = sorted(d for d in os.listdir(work) if done(os.path.join(work, d)))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as gz, \
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for run in runs:
            for name in KEEP:
                src = os.path.join(work, run, name)
                if not os.path.exists(src):
                    continue
                info = tar.gettarinfo(src, arcname=f"{run}/{name}")
                info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
                with open(src, "rb") as f:
                    tar.addfile(info, f)
    os.replace(path + ".tmp", path)
    return len(runs)


def unpack_kept(path, into):
    """Extract a keep() archive into the folder `into` (its members are checked: plain files under it)."""
    with tarfile.open(path, "r:gz") as tar:
        tar.extractall(into, filter="data")
    return into


# ---------------------------------------------------------------------------------------------
# Packing results for a device call
# ---------------------------------------------------------------------------------------------

def pack(paths, out_dir, name, part_mib=15, root=ROOT):
    """tar.gz of `paths` (folders or files relative to `root`; absent ones left out) split into parts of at
    most part_mib MiB: out_dir/name.tar.gz.part-00, -01, ... Rebuild in root: `cat name.tar.gz.part-* | tar xzf -`.
    Unfinished runs (a folder with a train.log and no done.json) stay out: their checkpoints and adapters
    are tens of MB each, they resume only on the machine that wrote them, and carried elsewhere such a run
    would start again from scratch anyway."""
    os.makedirs(out_dir, exist_ok=True)
    whole = os.path.join(out_dir, f"{name}.tar.gz")

    def finished_only(info):
        path = os.path.join(root, info.name)
        unfinished = info.isdir() and os.path.exists(os.path.join(path, "train.log")) and not done(path)
        return None if unfinished else info

    with tarfile.open(whole, "w:gz") as tar:
        for p in paths:
            if os.path.exists(os.path.join(root, p)):
                tar.add(os.path.join(root, p), arcname=os.path.normpath(p), filter=finished_only)
    size, limit, parts = os.path.getsize(whole), int(part_mib * 2**20), []
    with open(whole, "rb") as f:
        for i in range(max(1, math.ceil(size / limit))):
            part = f"{whole}.part-{i:02d}"
            with open(part, "wb") as g:
                g.write(f.read(limit))
            parts.append(part)
    os.remove(whole)
    return parts


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def read_json(path, what):
    if not os.path.exists(path):
        sys.exit(f"aqn_replication.py: {path} is missing: {what}")
    with open(path) as f:
        return json.load(f)


def arm_pair(text):
    """--controls: 'M,H', two of ARMS' numbers."""
    pair = tuple(int(x) for x in text.split(",") if x.strip())
    known = {a.number for a in ARMS}
    if len(pair) != 2 or not set(pair) <= known:
        raise argparse.ArgumentTypeError(f"{text!r}: give two arm numbers M,H from {sorted(known)}, e.g. 5,6 or 7,8")
    return pair


def parse_args(argv):
    p = argparse.ArgumentParser(description="The AQN replication: pilot, grid, analysis (see the module docstring).",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("command", choices=("pilot", "grid", "analyze", "keep", "pack"), help="what to do")
    p.add_argument("paths", nargs="*", help="pack: the files and folders to pack")
    p.add_argument("--out", default="results/aqn_replication", help="the small results (and calibration.json, "
                   "pilot.json)")
    p.add_argument("--work", default="runs/aqn_replication", help="the run folders (not committed; carry it between "
                   "device calls); analyze also reads a keep archive instead (results/aqn_replication/runs.tar.gz)")
    p.add_argument("--keep-to", default=None, help="keep: the archive of every run's raw records to write "
                   "(default: OUT/runs.tar.gz)")
    p.add_argument("--jobs", type=int, default=12, help="runs at a time, one CPU thread each")
    p.add_argument("--seeds", type=int, default=len(SEEDS), help="grid seeds: 0 .. N-1")
    p.add_argument("--arms", default=None, help="comma-separated arm numbers (default: 1-6, the first design's)")
    p.add_argument("--override", default="", help="train.py flags replacing COMMON's by name, one string "
                   "(e.g. --override='--model tiny --data arith --eval-data arith --device cpu --steps 2')")
    p.add_argument("--pilot-lrs", default=",".join(f"{x:g}" for x in PILOT_LRS), help="pilot: the lrs tried")
    p.add_argument("--pilot-seeds", default=",".join(map(str, PILOT_SEEDS)), help="pilot: the seeds")
    p.add_argument("--controls", type=arm_pair, default=CONTROLS, help="analyze/grid: the entropy-matched and the "
                   "positive control arms, as M,H (5,6: the temperature in sampler and trainer; 7,8: in the sampler "
                   "alone); the planned contrasts are 2-1, 4-1, 4-M, H-1")
    p.add_argument("--tau-hot", type=float, default=None, help="grid/analyze: the positive control's temperature "
                   "(default: calibration.json's tau_hot)")
    p.add_argument("--final-items", type=int, default=FINAL_ITEMS, help="eval.py held-out problems a run")
    p.add_argument("--final-samples", type=int, default=FINAL_SAMPLES, help="eval.py samples a problem")
    p.add_argument("--time-limit", type=float, default=None, help="seconds: stop launching, kill the running runs "
                   "(the next call continues them: from their last checkpoint on this machine, else from scratch), "
                   "then analyze what finished")
    p.add_argument("--min-run-s", type=float, default=150, help="with --time-limit: start no run in the last this "
                   "many seconds (a killed run resumes from its last checkpoint on this machine, else starts over)")
    p.add_argument("--mps", action="store_true", help="pilot/grid: run under CUDA MPS, so the runs' kernels share the "
                   "GPU side by side (about twice the runs an hour on an H100; falls back, saying so, where it cannot start)")
    p.add_argument("--keep-adapters", action="store_true", help="keep each run's adapter and checkpoint")
    p.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    p.add_argument("--pack-to", default=None, help="after the command, pack --out and --work (pruned) into this "
                   "folder (e.g. $OUT on a device call)")
    p.add_argument("--pack-name", default="replication", help="the packed archive's name")
    return p.parse_args(argv)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["tap"]:
        return tap(argv[1:])
    args = parse_args(argv)
    t0 = time.time()
    deadline = t0 + args.time_limit if args.time_limit else None
    out, work = os.path.join(ROOT, args.out), os.path.join(ROOT, args.work)
    if args.command == "pack":
        parts = pack(args.paths, args.pack_to or out, args.pack_name)
        print("wrote " + ", ".join(parts))
        return parts
    if args.command == "keep":
        path = args.keep_to or os.path.join(out, "runs.tar.gz")
        n = keep(work, path)
        print(f"kept the raw records of {n} runs: {path} ({os.path.getsize(path) / 2**20:.2f} MiB)")
        return path
    if work.endswith(".tar.gz"):
        if args.command != "analyze":
            sys.exit(f"aqn_replication.py: --work {args.work}: only analyze reads a keep archive")
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            return command(args, out, unpack_kept(work, tmp), t0, deadline)
    return command(args, out, work, t0, deadline)


def command(args, out, work, t0, deadline):
    """pilot, grid or analyze, on the run folders in `work`."""
    steps = int(common_flags(args.override)["--steps"])
    pilot_lrs = tuple(float(x) for x in args.pilot_lrs.split(","))
    pilot_seeds = tuple(int(s) for s in args.pilot_seeds.split(","))
    if args.command == "pilot":
        jobs = pilot_jobs(work, args.override, pilot_lrs, pilot_seeds)
    else:
        if args.command == "analyze":  # the pilot's choice, recomputed from its runs where they are at hand
            pjobs = pilot_jobs(work, args.override, pilot_lrs, pilot_seeds)
            if any(done(j.run_dir) for j in pjobs):
                write_pilot(pjobs, out, steps)
        cal_path, pilot_path = os.path.join(out, "calibration.json"), os.path.join(out, "pilot.json")
        lr = parse_flags(args.override).get("--lr")
        if args.dry_run:  # (before the calibration and the pilot: their values stay placeholders)
            cal = read_json(cal_path, "") if os.path.exists(cal_path) else None
            lr = lr or (read_json(pilot_path, "")["lr"] if os.path.exists(pilot_path) else None)
        else:
            cal = read_json(cal_path, "run experiments/calibrate.py first")
            lr = lr or read_json(pilot_path, "run the pilot first (or pass --lr in --override)")["lr"]
        if cal is not None and args.tau_hot is not None:
            cal = {**cal, "tau_hot": args.tau_hot}
        wanted = [x.strip() for x in args.arms.split(",") if x.strip()] if args.arms else []
        if unknown := sorted(set(wanted) - {str(a.number) for a in ARMS}):
            sys.exit(f"aqn_replication.py: --arms {args.arms}: no arm {', '.join(unknown)}; the arms are "
                     f"{', '.join(str(a.number) for a in ARMS)} (see ARMS)")
        arms = [a for a in ARMS if str(a.number) in wanted] or None
        jobs = grid_jobs(work, cal, None if lr is None else float(lr), args.override, tuple(range(args.seeds)), arms,
                         args.final_items, args.final_samples, placeholders=args.dry_run)
    if args.dry_run:
        for j in jobs:
            for stage, cmd in j.stages:
                print(f"{j.name} {stage}: python " + " ".join(cmd[1:]).replace(ROOT + "/", ""))
        return jobs
    if args.command in ("pilot", "grid"):
        missing = missing_flags(jobs)
        if missing:
            sys.exit(f"aqn_replication.py: train.py does not know {missing} (see `python train.py --help`): adjust "
                     f"COMMON or ARMS")
        os.makedirs(work, exist_ok=True)
        with mps(args.mps):
            run_all(jobs, args.jobs, deadline, args.keep_adapters, args.min_run_s)
    if args.command == "pilot":
        result = write_pilot(jobs, out, steps)
    else:
        result = write_results(jobs, out, args)
    if args.pack_to:
        print("packed " + ", ".join(pack([args.out, args.work], args.pack_to, args.pack_name)))
    print(f"total wall time {time.time() - t0:.0f} s")
    return result


def write_pilot(jobs, out, steps):
    curves, per_lr, seeds = {}, {}, sorted({j.seed for j in jobs})
    for j in jobs:
        got = collect_run(j.run_dir)
        if got is None:
            continue
        row, c = got
        curves.setdefault(j.lr, []).append(c["sampler_entropy"])
        per_lr.setdefault(j.lr, []).append(row)
    if not curves:
        print("the pilot has no finished run yet: run the same command again to continue")
        return None
    lr, collapse = choose_lr(curves, steps)
    pilot = {"lr": lr, "steps": steps, "seeds": seeds, "complete": sum(map(len, per_lr.values())) == len(jobs),
             "per_lr": {f"{x:g}": {"collapse_step": collapse[x], "runs": len(rs),
                                   "reward_area": float(np.mean([r["reward_area"] for r in rs])),
                                   "step_s": float(np.mean([r["step_s"] for r in rs])),
                                   "run_s": float(np.mean([r["wall_s"] for r in rs]))}
                        for x, rs in sorted(per_lr.items())}}
    os.makedirs(out, exist_ok=True)
    import hub

    hub.write_json(os.path.join(out, "pilot.json"), pilot)
    print(f"pilot: lr {lr:g} chosen ({'complete' if pilot['complete'] else 'INCOMPLETE: run it again'}); collapse steps "
          f"{ {f'{k:g}': v for k, v in collapse.items()} }; wrote {out}/pilot.json")
    return pilot


def write_results(jobs, out, args):
    rows, curves, dropped = collect(jobs)
    res = analyze(rows, args.controls)
    settings = (f"{len(rows)} of {len(jobs)} runs finished; train.py flags {' '.join(flag_list(common_flags(args.override, jobs[0].lr)))}; "
                f"eval.py {args.final_items} held-out problems x {args.final_samples} samples at T=1"
                + ("" if args.tau_hot is None else f"; tau_hot {args.tau_hot:g} (--tau-hot, not calibration.json's)"))
    os.makedirs(out, exist_ok=True)
    if rows:
        write_rows(os.path.join(out, "runs.csv"), rows)
    rounded = {k: {n: [None if v is None else round(v, 6) for v in vs] for n, vs in c.items()} for k, c in curves.items()}
    with open(os.path.join(out, "curves.json"), "w") as f:
        ran = {j.arm for j in jobs}
        json.dump({"arms": {a.number: [a.name, a.label, *a.flags] for a in ARMS if a in ran}, "runs": rounded}, f,
                  separators=(",", ":"))
    table = table_md(res, settings, dropped)
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table)
    if curves:
        plot(curves, os.path.join(out, "curves.png"))
    if res["contrasts"]:
        plot_paired(res, os.path.join(out, "paired.png"))
    readme = os.path.join(out, "README.md")
    if os.path.exists(readme):
        sections = {"results": table.split("\n", 2)[2]}
        cal_csv = os.path.join(out, "calibration.csv")
        if os.path.exists(cal_csv):
            with open(cal_csv) as f:
                sections["calibration"] = calibration_md(read_json(os.path.join(out, "calibration.json"), ""),
                                                         list(csv.DictReader(f)))
        if os.path.exists(os.path.join(out, "pilot.json")):
            sections["pilot"] = pilot_md(read_json(os.path.join(out, "pilot.json"), ""))
        fill_readme(readme, sections)
    for d in dropped:
        print(f"DROPPED {d}")
    print(f"{len(rows)}/{len(jobs)} runs finished; statement: {statement(res)[0]}; wrote {out}/runs.csv, curves.json, "
          f"table.md, curves.png, paired.png")
    if len(rows) + len(dropped) < len(jobs):
        print("the grid is incomplete: run the same command again to continue")
    return rows


if __name__ == "__main__":
    main()
