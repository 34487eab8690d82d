"""experiments/aqn_grid.py: does quantization noise help exploration? A small, paired, multi-seed test.

    python experiments/aqn_grid.py --jobs 16                     # the whole grid, 16 runs at a time
    python experiments/aqn_grid.py --jobs 2 --dry-run            # print the command lines only
    python experiments/aqn_grid.py --seeds 1 --steps 2 --jobs 1 --algos grpo --arms bf16,nvfp4-aqn-trainer   # smoke

The question. QeRL (arXiv 2510.11696) claims that the NVFP4 base's quantization error raises the policy's
entropy at the start of RL, and that Adaptive Quantization Noise (AQN: scheduled Gaussian noise on the
RMSNorm weights during rollout, aqn.py) makes the reward grow faster and end higher than 16-bit LoRA.
Here the bundled tiny policy (train.py's default: model tiny, the synthetic arith task, CPU) is trained
under each arm, with DAPO and with GRPO, for several seeds, and every arm is compared with bf16-LoRA on
the same seeds.

The arms (ARMS below), each a set of train.py flags:
    bf16                bf16-LoRA, no noise                      --quant bf16  --no-aqn --ratio trainer
    bf16-aqn            bf16-LoRA + AQN (never run officially)   --quant bf16           --ratio trainer
    nvfp4               NVFP4-LoRA, quantization noise only      --quant nvfp4 --no-aqn --ratio trainer
    nvfp4-aqn-trainer   NVFP4-LoRA + AQN, ratio vs the trainer   --quant nvfp4          --ratio trainer
    nvfp4-aqn-sampler   NVFP4-LoRA + AQN, ratio vs the sampler   --quant nvfp4          --ratio sampler
    nvfp4-aqn-tis       NVFP4-LoRA + AQN, truncated IS           --quant nvfp4          --ratio tis
The first four use train.py's default ratio mode (trainer), named explicitly so the grid says so; only
NVFP4 + AQN varies it. A bf16 base with AQN is a real arm: train.py draws the noise whatever the base's
format, aqn.noise raises if it changes no norm weight, and the runs' logged sigma (runs.csv max_sigma)
and nonzero sampler-trainer KL show it was on. Every other setting is train.py's default for the tiny
model: curves.json records them as one run's full args.json ("train_settings"), and --train-args adds
flags to every run.

Each run is `python experiments/probe.py RUN/probe.jsonl -- --out RUN/run ...flags` (train.py, unchanged, with
read-only taps: see probe.py for why its own reward and entropy are not enough), then `python eval.py`
on the saved adapter with 8 samples an item for pass@k. Runs are independent subprocesses, --jobs at a
time, one CPU thread each. Their folders go to --work (not committed): WORK/<algo>-<arm>-s<seed>/ holds
train.py's folder run/, eval.py's eval8/, probe.jsonl and the two logs. A run whose run/ holds a
summary.json is not trained again, so a cut-short grid resumes where it stopped (--time-limit cuts it on
purpose); an unfinished one is deleted and started again. The small results go to --out.

Per run (runs.csv): the sampler's mean token entropy at step 0 and over the first --first-steps steps
(probe.py: the mean -logp of the sampled tokens, AQN noise included), the trainer's entropy (train.py's
`entropy`: the update pass, without noise, DAPO's kept groups only), the reward curve (the fraction of
*all* sampled completions that were right) and its area (its mean over steps), the held-out accuracy at
the end (train.py, one sample an item) and pass@1/2/4/8 (eval.py, 8 samples an item, temperature 1),
and train.py's sampler-trainer KL (mean over steps: how far AQN moves the sampler from the trainer,
which is what the ratio modes differ on). Per step (curves.json): reward, both entropies, sigma.

How to read the results (table.md, curves.png). For each algo and arm: the mean over seeds and a 95%
t-interval. Then each arm minus bf16 on the same seed and algo: the mean paired difference, its 95%
t-interval, and the exact two-sided sign-flip permutation p-value of that mean. The seeds fix the data
order, the sampling and the LoRA init, so a paired difference removes what the seed alone explains.
With n seeds the smallest possible sign-flip p is 2 / 2^n: 0.0625 with 5 seeds, so 5 seeds can never
reach p < 0.05 however large the effect; read the interval, and add seeds (--seeds 8: 0.0078) where
an effect matters. Note that stage 0 of the AQN schedule is noise-free, so step 0 shows only the
quantization's effect on entropy; AQN's appears from the second stage on (curves.png, lower panels).
"""
import argparse
import csv
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    flags: tuple


ARMS = (
    Arm("bf16", "bf16-LoRA", ("--quant", "bf16", "--no-aqn", "--ratio", "trainer")),
    Arm("bf16-aqn", "bf16-LoRA + AQN", ("--quant", "bf16", "--ratio", "trainer")),
    Arm("nvfp4", "NVFP4-LoRA", ("--quant", "nvfp4", "--no-aqn", "--ratio", "trainer")),
    Arm("nvfp4-aqn-trainer", "NVFP4-LoRA + AQN, ratio trainer", ("--quant", "nvfp4", "--ratio", "trainer")),
    Arm("nvfp4-aqn-sampler", "NVFP4-LoRA + AQN, ratio sampler", ("--quant", "nvfp4", "--ratio", "sampler")),
    Arm("nvfp4-aqn-tis", "NVFP4-LoRA + AQN, ratio tis", ("--quant", "nvfp4", "--ratio", "tis")),
)
BASELINE = "bf16"
ALGOS = ("dapo", "grpo")
KS = (1, 2, 4, 8)
TRAIN_DIR, EVAL_DIR = "run", "eval8"  # train.py's and eval.py's --out inside a run folder (each wants a new one)


# ---------------------------------------------------------------------------------------------
# Statistics (numpy only)
# ---------------------------------------------------------------------------------------------

def t_cdf(x, df):
    """Student's t CDF by integrating its density from 0 (Simpson's rule, 4001 points)."""
    if x < 0:
        return 1.0 - t_cdf(-x, df)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    u = np.linspace(0.0, x, 4001)
    f = c * (1 + u * u / df) ** (-(df + 1) / 2)
    h = x / 4000
    return 0.5 + h / 3 * (f[0] + f[-1] + 4 * f[1:-1:2].sum() + 2 * f[2:-1:2].sum())


def t_quantile(p, df):
    """The t quantile for p in (0.5, 1), by bisection on t_cdf."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


def mean_ci(x, level=0.95):
    """(mean, low, high): the mean and its t-interval over the finite values of x; the interval is NaN
    with fewer than 2 of them."""
    x = np.asarray([v for v in x if v is not None and np.isfinite(v)], dtype=float)
    if len(x) == 0:
        return math.nan, math.nan, math.nan
    m = float(x.mean())
    if len(x) < 2:
        return m, math.nan, math.nan
    half = t_quantile(0.5 + level / 2, len(x) - 1) * float(x.std(ddof=1)) / math.sqrt(len(x))
    return m, m - half, m + half


SIGN_FLIP_EXACT_MAX, SIGN_FLIP_DRAWS = 16, 200_000  # sign_flip_p: exact up to this many pairs, else this many draws


def sign_flip_p(d, exact_max=SIGN_FLIP_EXACT_MAX, draws=SIGN_FLIP_DRAWS, seed=0):
    """Two-sided p-value of the paired sign-flip permutation test of mean(d) = 0: the fraction of sign
    patterns whose |mean| is at least the observed one. Exact over all 2^n patterns up to n = exact_max,
    Monte Carlo (with the observed pattern counted) beyond."""
    d = np.asarray(d, dtype=float)
    n = len(d)
    if n == 0:
        return math.nan
    obs = abs(d.mean()) - 1e-12 * max(1.0, abs(d).max())  # ties count as extreme
    if n <= exact_max:
        signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))  # (2^n, n)
        return float((np.abs(signs @ d / n) >= obs).mean())
    signs = np.random.default_rng(seed).choice((1.0, -1.0), size=(draws, n))
    return float(((np.abs(signs @ d / n) >= obs).sum() + 1) / (draws + 1))


def paired(a, b):
    """Compare arm a with baseline b on the seeds both have ({seed: value} each): (n, mean difference,
    low, high, p)."""
    seeds = sorted(s for s in a if s in b and a[s] is not None and b[s] is not None
                   and np.isfinite(a[s]) and np.isfinite(b[s]))
    d = [a[s] - b[s] for s in seeds]
    m, lo, hi = mean_ci(d)
    return len(d), m, lo, hi, sign_flip_p(d)


# ---------------------------------------------------------------------------------------------
# The grid: one job per (algo, arm, seed)
# ---------------------------------------------------------------------------------------------

@dataclass
class Job:
    algo: str
    arm: Arm
    seed: int
    run_dir: str
    train_cmd: list
    eval_cmd: list


def quant_of(arm):
    return arm.flags[arm.flags.index("--quant") + 1]


def build_grid(args):
    """Every (algo, arm, seed) of the experiment with its two command lines, in launch order: seed by
    seed, so a grid cut short holds complete pairs for the first seeds rather than whole arms."""
    arms = select_arms(args.arms)
    jobs = []
    for seed in range(args.seed0, args.seed0 + args.seeds):
        for algo in args.algos.split(","):
            for arm in arms:
                run = os.path.join(args.work, f"{algo}-{arm.name}-s{seed}")
                train_cmd = [sys.executable, "experiments/probe.py", os.path.join(run, "probe.jsonl"), "--",
                             "--out", os.path.join(run, TRAIN_DIR), "--model", args.model, "--data", args.data, "--device", "cpu",
                             "--algo", algo, "--seed", str(seed), *arm.flags,
                             "--eval-every", "0", "--eval-limit", str(args.eval_limit),
                             "--save-every", "0", "--plot-every", "1000000", "--log-samples", "1"]
                if args.steps:
                    train_cmd += ["--steps", str(args.steps)]
                train_cmd += args.train_args.split()
                eval_cmd = [sys.executable, "eval.py", "--model", args.model, "--adapter", os.path.join(run, TRAIN_DIR, "adapter"),
                            "--quant", quant_of(arm), "--data", args.data, "--limit", str(args.eval_limit),
                            "--samples", str(max(KS)), "--temperature", "1.0", "--top-p", "1.0",
                            "--max-new-tokens", str(args.eval_max_new_tokens), "--device", "cpu",
                            "--seed", str(seed), "--out", os.path.join(run, EVAL_DIR)]
                jobs.append(Job(algo, arm, seed, run, train_cmd, eval_cmd))
    return jobs


def select_arms(names):
    if not names:
        return list(ARMS)
    by_name = {a.name: a for a in ARMS}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
        sys.exit(f"aqn_grid.py: unknown arm(s) {unknown}; choose from {list(by_name)}")
    return [by_name[n] for n in names.split(",")]


def missing_flags(jobs):
    """train.py flags the grid uses that `python train.py --help` does not list."""
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"aqn_grid.py: `python train.py --help` failed:\n{out.stderr}")
    used = {t for j in jobs for t in j.train_cmd[4:] if t.startswith("--")}
    return sorted(f for f in used if not re.search(r"(?<![\w-])" + re.escape(f) + r"(?![\w-])", out.stdout))


# ---------------------------------------------------------------------------------------------
# Running the jobs
# ---------------------------------------------------------------------------------------------

def job_env():
    """One CPU thread a job, so --jobs N uses N cores; no progress bars in the logs."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    return env


def trained(run_dir):
    return os.path.exists(os.path.join(run_dir, TRAIN_DIR, "summary.json"))


def evaluated(run_dir):
    return os.path.exists(os.path.join(run_dir, EVAL_DIR, "summary.json"))


class Stop:
    """When to stop: past the --time-limit deadline, or once set (Ctrl-C)."""

    def __init__(self, deadline=None):
        self.deadline, self.event = deadline, threading.Event()

    def __call__(self):
        return self.event.is_set() or (self.deadline is not None and time.time() > self.deadline)


def run_cmd(cmd, log, stop, procs):
    """Run cmd from the repository root, its output to log, in its own process group, which is killed
    once stop() says so. Returns the exit code (None when killed)."""
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=job_env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        procs.add(p)
        try:
            while True:
                try:
                    return p.wait(timeout=2)
                except subprocess.TimeoutExpired:
                    if stop():
                        os.killpg(p.pid, signal.SIGTERM)
                        p.wait()
                        return None
        finally:
            procs.discard(p)


def run_job(job, stop, procs):
    """Train (unless the folder already holds a finished run), then evaluate pass@k. Returns a status line."""
    t0 = time.time()
    for done, cmd, log in ((trained, job.train_cmd, "train.log"), (evaluated, job.eval_cmd, "eval.log")):
        if done(job.run_dir):
            continue
        if stop():
            return "not started (stopped)"
        if done is trained:  # an unfinished run of this grid (or none): start it from scratch
            shutil.rmtree(job.run_dir, ignore_errors=True)
            os.makedirs(job.run_dir)
        else:  # an evaluation cut short
            shutil.rmtree(os.path.join(job.run_dir, EVAL_DIR), ignore_errors=True)
        rc = run_cmd(cmd, os.path.join(job.run_dir, log), stop, procs)
        if rc != 0:
            return f"{log[:-4]} {'killed (stopped)' if rc is None else f'FAILED rc={rc}'}: see {job.run_dir}/{log}"
    return f"done in {time.time() - t0:.0f} s"


def run_grid(jobs, n_jobs, deadline):
    todo = [j for j in jobs if not (trained(j.run_dir) and evaluated(j.run_dir))]
    print(f"{len(jobs)} runs in the grid, {len(jobs) - len(todo)} already done, {len(todo)} to run, {n_jobs} at a time")
    stop, procs = Stop(deadline), set()
    with ThreadPoolExecutor(max_workers=n_jobs) as pool:
        futures = {pool.submit(run_job, j, stop, procs): j for j in todo}
        try:
            for i, fut in enumerate(as_completed(futures)):
                j = futures[fut]
                print(f"[{i + 1}/{len(todo)}] {j.algo} {j.arm.name} seed {j.seed}: {fut.result()}", flush=True)
        except KeyboardInterrupt:  # the runs are in their own process groups: Ctrl-C reaches only us
            stop.event.set()
            print("stopping: killing the running runs (they start again on the next call)", flush=True)
            raise


# ---------------------------------------------------------------------------------------------
# Collecting and aggregating
# ---------------------------------------------------------------------------------------------

METRICS = (  # (key in a runs.csv row, table header)
    ("sampler_entropy_0", "H sampler, step 0"),
    ("sampler_entropy_first", "H sampler, first steps"),
    ("trainer_entropy_0", "H trainer, step 0"),
    ("reward_auc", "reward area"),
    ("reward_last", "reward, last 5"),
    ("final_accuracy", "held-out acc"),
    ("mismatch_kl", "sampler-trainer KL"),
) + tuple((f"pass@{k}", f"pass@{k}") for k in KS)


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def mean_of(values):
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else math.nan


def collect_run(run_dir, first_steps):
    """A finished run's numbers (one runs.csv row, and its curves), or None while it is unfinished."""
    if not (trained(run_dir) and evaluated(run_dir) and os.path.exists(os.path.join(run_dir, "probe.jsonl"))):
        return None
    with open(os.path.join(run_dir, TRAIN_DIR, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, EVAL_DIR, "summary.json")) as f:
        ev = json.load(f)
    metrics = read_jsonl(os.path.join(run_dir, TRAIN_DIR, "metrics.jsonl"))
    probe = {r["step"]: r for r in read_jsonl(os.path.join(run_dir, "probe.jsonl"))}
    steps = [m["step"] for m in metrics]
    reward = [probe.get(s, {}).get("sampled_accuracy") for s in steps]
    h_sampler = [probe.get(s, {}).get("sampler_entropy") for s in steps]
    h_trainer = [m.get("entropy") for m in metrics]
    row = {
        "sampler_entropy_0": h_sampler[0] if h_sampler and h_sampler[0] is not None else math.nan,
        "sampler_entropy_first": mean_of(h_sampler[:first_steps]),
        "trainer_entropy_0": h_trainer[0] if h_trainer and h_trainer[0] is not None else math.nan,
        "trainer_entropy_first": mean_of(h_trainer[:first_steps]),
        "reward_auc": mean_of(reward),
        "reward_last": mean_of(reward[-5:]),
        "baseline_accuracy": summary.get("baseline_accuracy", math.nan),
        "final_accuracy": summary.get("final_accuracy", math.nan),
        "mismatch_kl": mean_of([m.get("mismatch_kl") for m in metrics]),  # (train.py's, a step's mean)
        "max_sigma": max((m.get("sigma") or 0.0) for m in metrics),
        "steps": len(metrics),
        "wall_s": summary.get("wall_time_s", math.nan) + ev.get("seconds", 0.0),
    }
    pk = {int(k): v for k, v in ev["pass@k"].items()}
    row.update({f"pass@{k}": pk.get(k, math.nan) for k in KS})
    curves = {"step": steps, "reward": reward, "sampler_entropy": h_sampler, "trainer_entropy": h_trainer,
              "sigma": [m.get("sigma") for m in metrics]}
    return row, curves


def collect(jobs, first_steps):
    """(runs.csv rows, {"algo/arm/seed": curves}) of the finished runs of the grid."""
    rows, curves = [], {}
    for j in jobs:
        got = collect_run(j.run_dir, first_steps)
        if got is None:
            continue
        row, c = got
        rows.append({"algo": j.algo, "arm": j.arm.name, "seed": j.seed, **row})
        curves[f"{j.algo}/{j.arm.name}/{j.seed}"] = c
    return rows, curves


def aggregate(rows):
    """{(algo, arm): {"n", metric: (mean, lo, hi), "vs_baseline": {metric: (n, diff, lo, hi, p)}}}."""
    by = {}
    for r in rows:
        by.setdefault((r["algo"], r["arm"]), {})[r["seed"]] = r
    out = {}
    for (algo, arm), seeds in by.items():
        base = by.get((algo, BASELINE), {})
        entry = {"n": len(seeds)}
        for key, _ in METRICS:
            entry[key] = mean_ci([r[key] for r in seeds.values()])
        if arm != BASELINE and base:
            entry["vs_baseline"] = {key: paired({s: r[key] for s, r in seeds.items()}, {s: r[key] for s, r in base.items()})
                                    for key, _ in METRICS}
        out[(algo, arm)] = entry
    return out


# ---------------------------------------------------------------------------------------------
# Writing the results
# ---------------------------------------------------------------------------------------------

def num(v, sign=""):
    """Three decimals, or three significant digits for small numbers (the sampler-trainer KL)."""
    return f"{v:{sign}.3f}" if v == 0 or abs(v) >= 1e-3 else f"{v:{sign}.2e}"


def fmt_ci(m, lo, hi):
    if not np.isfinite(m):
        return "–"
    return num(m) if not np.isfinite(lo) else f"{num(m)} [{num(lo)}, {num(hi)}]"


def fmt_diff(n, m, lo, hi, p):
    if n == 0:
        return "–"
    return f"{num(m, '+')} [{num(lo, '+')}, {num(hi, '+')}] p={p:.3g}" if np.isfinite(lo) else f"{num(m, '+')} (n=1)"


def table_md(agg, settings):
    arms = [a for a in ARMS if any(k[1] == a.name for k in agg)]
    algos = [a for a in ALGOS if any(k[0] == a for k in agg)]
    lines = ["# Does quantization noise help exploration? (experiments/aqn_grid.py)", "",
             f"Settings: {settings}", "",
             "Each cell: mean over seeds [95% t-interval]. Entropies in nats a token. Reward: the fraction of all "
             "sampled completions that were right (area = its mean over steps). Held-out acc: train.py's final "
             "evaluation (one sample an item); pass@k: eval.py, 8 samples an item at temperature 1. "
             "The second table of each algo: arm minus bf16-LoRA on the same seeds, [95% t-interval of the paired "
             "difference], p = exact two-sided sign-flip permutation p (its smallest possible value with n seeds "
             "is 2/2^n).", ""]
    for algo in algos:
        head = "| arm | n | " + " | ".join(h for _, h in METRICS) + " |"
        sep = "|" + "---|" * (len(METRICS) + 2)
        lines += [f"## {algo}", "", head, sep]
        for a in arms:
            e = agg.get((algo, a.name))
            if e:
                lines.append(f"| {a.label} | {e['n']} | " + " | ".join(fmt_ci(*e[k]) for k, _ in METRICS) + " |")
        lines += ["", f"{algo}, paired difference with bf16-LoRA:", "", head.replace("| n |", "| pairs |"), sep]
        for a in arms:
            e = agg.get((algo, a.name))
            if e and "vs_baseline" in e:
                vb = e["vs_baseline"]
                n = max(v[0] for v in vb.values())
                lines.append(f"| {a.label} | {n} | " + " | ".join(fmt_diff(*vb[k]) for k, _ in METRICS) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def band(values):
    """Per step: mean and t-interval over the runs (curves of equal length)."""
    arr = np.array([[np.nan if v is None else v for v in c] for c in values], dtype=float)  # (runs, steps)
    stats = [mean_ci(arr[:, i]) for i in range(arr.shape[1])]
    return tuple(np.array(s) for s in zip(*stats))


def plot_curves(curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    algos = [a for a in ALGOS if any(k.startswith(a + "/") for k in curves)]
    panels = (("reward", "fraction of sampled completions right"), ("sampler_entropy", "sampler entropy (nats/token)"))
    fig, axes = plt.subplots(len(panels), max(1, len(algos)), figsize=(6.5 * max(1, len(algos)), 8), squeeze=False)
    for col, algo in enumerate(algos):
        for row, (key, ylabel) in enumerate(panels):
            ax = axes[row, col]
            for arm in ARMS:
                runs = [c for k, c in curves.items() if k.startswith(f"{algo}/{arm.name}/")]
                if not runs:
                    continue
                length = min(len(c[key]) for c in runs)
                m, lo, hi = band([c[key][:length] for c in runs])
                x = np.arange(length)
                ax.plot(x, m, label=f"{arm.label} (n={len(runs)})")
                if len(runs) > 1:
                    ax.fill_between(x, lo, hi, alpha=0.15)
            ax.set_title(f"{algo}: {key.replace('_', ' ')} (mean, 95% interval over seeds)")
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
        axes[0, col].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def train_settings(jobs):
    """The full train.py settings (args.json) of the first finished run: every default the grid left to
    train.py, for the record (the arms differ from it only in their flags, the seeds in --seed)."""
    for j in jobs:
        path = os.path.join(j.run_dir, TRAIN_DIR, "args.json")
        if trained(j.run_dir) and os.path.exists(path):
            with open(path) as f:
                return {"run": os.path.basename(j.run_dir), "args": json.load(f)}
    return None


def write_results(out, rows, curves, agg, settings, train_args=None):
    os.makedirs(out, exist_ok=True)
    if rows:
        with open(os.path.join(out, "runs.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    rounded = {k: {n: [None if v is None else round(v, 5) for v in vs] for n, vs in c.items()} for k, c in curves.items()}
    with open(os.path.join(out, "curves.json"), "w") as f:
        json.dump({"settings": settings, "arms": {a.name: list(a.flags) for a in ARMS}, "train_settings": train_args,
                   "runs": rounded}, f, separators=(",", ":"))
    with open(os.path.join(out, "table.md"), "w") as f:
        f.write(table_md(agg, settings))
    if curves:
        plot_curves(curves, os.path.join(out, "curves.png"))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------

def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Does quantization noise help exploration? Train the tiny policy under "
                                "bf16 / NVFP4, with and without AQN, each ratio mode, DAPO and GRPO, over seeds.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default="results/aqn_experiment", help="folder for the small results (csv, json, md, png)")
    p.add_argument("--work", default="runs/aqn_experiment", help="folder for the run folders (adapters, logs; not committed)")
    p.add_argument("--jobs", type=int, default=2, help="runs at a time, one CPU thread each")
    p.add_argument("--seeds", type=int, default=5, help="seeds per (algo, arm)")
    p.add_argument("--seed0", type=int, default=0, help="first seed")
    p.add_argument("--steps", type=int, default=None, help="RL steps a run (default: train.py's, 30 for tiny)")
    p.add_argument("--algos", default=",".join(ALGOS), help="comma-separated subset of dapo,grpo")
    p.add_argument("--arms", default=None, help=f"comma-separated subset of {','.join(a.name for a in ARMS)} (default all)")
    p.add_argument("--model", default="tiny", help="train.py / eval.py --model")
    p.add_argument("--data", default="arith", help="train.py --data and eval.py --data (held-out: its test split)")
    p.add_argument("--eval-limit", type=int, default=256, help="held-out items, for train.py's final evaluation and pass@k")
    p.add_argument("--eval-max-new-tokens", type=int, default=64, help="eval.py completion budget (train.py's tiny default)")
    p.add_argument("--first-steps", type=int, default=5, help="steps averaged for 'first steps' entropy")
    p.add_argument("--train-args", default="", help="extra train.py flags for every run, one string "
                   "(e.g. --train-args='--no-train-norms')")
    p.add_argument("--time-limit", type=float, default=None, help="seconds: stop launching, kill running runs (they "
                   "restart on the next call) and write the results of the finished ones")
    p.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    t0 = time.time()
    args.work, args.out = os.path.abspath(args.work), os.path.abspath(args.out)
    for a in args.algos.split(","):
        if a not in ALGOS:
            sys.exit(f"aqn_grid.py: unknown algo {a!r}; choose from {ALGOS}")
    if args.jobs < 1 or args.seeds < 1:
        sys.exit("aqn_grid.py: --jobs and --seeds must be >= 1")
    jobs = build_grid(args)
    if args.dry_run:
        for j in jobs:
            print("python " + " ".join(j.train_cmd[1:]).replace(ROOT + "/", ""))
            print("  then python " + " ".join(j.eval_cmd[1:]).replace(ROOT + "/", ""))
        print(f"{len(jobs)} runs")
        return jobs
    missing = missing_flags(jobs)
    if missing:
        sys.exit(f"aqn_grid.py: train.py does not know {missing} (see `python train.py --help`); the arms need them. "
                 f"Run a subset without them (--arms) or wait for train.py to grow them.")
    os.makedirs(args.work, exist_ok=True)
    deadline = t0 + args.time_limit if args.time_limit else None
    run_grid(jobs, args.jobs, deadline)
    rows, curves = collect(jobs, args.first_steps)
    agg = aggregate(rows)
    settings = (f"model {args.model}, data {args.data}, steps {args.steps or 'train.py default'}, seeds "
                f"{args.seed0}..{args.seed0 + args.seeds - 1}, algos {args.algos}, held-out items {args.eval_limit}, "
                f"extra train.py flags '{args.train_args}'; {len(rows)} of {len(jobs)} runs finished")
    write_results(args.out, rows, curves, agg, settings, train_settings(jobs))
    no_noise = [r for r in rows if "aqn" in r["arm"] and not r["max_sigma"] > 0]
    if no_noise:
        print(f"WARNING: {len(no_noise)} AQN runs logged no sigma > 0 (too few steps for a noisy stage?)")
    print(f"{len(rows)}/{len(jobs)} runs finished; wrote {args.out}/runs.csv, curves.json, table.md, curves.png")
    if len(rows) < len(jobs):
        print("the grid is incomplete: run the same command again to continue")
    print(f"total wall time {time.time() - t0:.0f} s")
    return rows


if __name__ == "__main__":
    main()
