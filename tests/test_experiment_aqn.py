"""experiments/aqn_grid.py without training anything: its statistics against hand-computed values, the grid
of command lines, and the aggregation of fake run folders written here."""
import json
import math
import os
import subprocess

import pytest

from experiments import aqn_grid as exp


# --- statistics ---------------------------------------------------------------------------------

def test_t_quantile_matches_tables():
    # two-sided 95% critical values from any t table
    for df, t in [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423)]:
        assert exp.t_quantile(0.975, df) == pytest.approx(t, abs=2e-4)
    assert exp.t_cdf(0.0, 5) == pytest.approx(0.5)
    assert exp.t_cdf(-2.7764451, 4) == pytest.approx(0.025, abs=1e-6)


def test_mean_ci_by_hand():
    # mean 3, sd sqrt(2.5), se sqrt(2.5/5) = 0.70711, t(0.975, 4) = 2.776445 -> half 1.963243
    m, lo, hi = exp.mean_ci([1, 2, 3, 4, 5])
    assert m == pytest.approx(3.0)
    assert (lo, hi) == (pytest.approx(1.036757, abs=1e-5), pytest.approx(4.963243, abs=1e-5))
    m, lo, hi = exp.mean_ci([0.25, None, float("nan")])  # one finite value: no interval
    assert m == 0.25 and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(v) for v in exp.mean_ci([]))


def test_sign_flip_p_exact_by_hand():
    # all five positive: only the all-plus and all-minus patterns reach |mean| 3 -> 2/32
    assert exp.sign_flip_p([1, 2, 3, 4, 5]) == pytest.approx(0.0625)
    # |sum| of (+-3, +-1, +-1, +-1) reaches 6 only with equal signs -> 2/16
    assert exp.sign_flip_p([3, 1, 1, 1]) == pytest.approx(0.125)
    # +-2 +-1 +-0.5: |sums| 3.5, 2.5, 1.5, 0.5 twice each; observed |2 - 1 + 0.5| = 1.5 -> 6/8
    assert exp.sign_flip_p([2, -1, 0.5]) == pytest.approx(0.75)
    assert exp.sign_flip_p([1, -1, 1, -1]) == pytest.approx(1.0)
    # the Monte Carlo branch estimates the same number
    assert exp.sign_flip_p([1, 2, 3, 4, 5], exact_max=3, draws=40_000) == pytest.approx(0.0625, abs=0.006)


def test_paired_uses_common_seeds_only():
    a = {0: 1.0, 1: 2.0, 2: 3.0}
    b = {0: 0.0, 1: 0.0, 2: 1.0, 3: 5.0}  # seed 3 has no partner
    n, m, lo, hi, p = exp.paired(a, b)
    # differences 1, 2, 2: mean 5/3, sd sqrt(1/3), se 1/3, t(0.975, 2) = 4.302653
    assert n == 3 and m == pytest.approx(5 / 3)
    assert hi - m == pytest.approx(4.302653 / 3, abs=1e-5) and m - lo == pytest.approx(4.302653 / 3, abs=1e-5)
    assert p == pytest.approx(0.25)  # 2 of 8 sign patterns reach |sum| 5


# --- the grid -----------------------------------------------------------------------------------

def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_grid_is_arms_by_algos_by_seeds():
    args = exp.parse_args(["--seeds", "5", "--steps", "7", "--work", "/tmp/w"])
    jobs = exp.build_grid(args)
    assert len(jobs) == len(exp.ARMS) * 2 * 5 == 60
    assert len({j.run_dir for j in jobs}) == 60
    seen = {(j.algo, j.arm.name, j.seed) for j in jobs}
    assert seen == {(a, arm.name, s) for a in ("dapo", "grpo") for arm in exp.ARMS for s in range(5)}
    for j in jobs:
        t, e = j.train_cmd, j.eval_cmd
        assert t[1].endswith("experiments/probe.py") and t[3] == "--"
        assert flag(t, "--out") == os.path.join(j.run_dir, "run") and flag(t, "--algo") == j.algo and flag(t, "--seed") == str(j.seed)
        assert flag(t, "--steps") == "7"
        quant, ratio = flag(t, "--quant"), flag(t, "--ratio")
        assert ("--no-aqn" in t) == (j.arm.name in ("bf16", "nvfp4"))
        assert quant == ("bf16" if j.arm.name.startswith("bf16") else "nvfp4")
        # only NVFP4 + AQN varies the ratio; every other arm uses train.py's default, trainer
        assert ratio == (j.arm.name.rsplit("-", 1)[1] if j.arm.name.startswith("nvfp4-aqn") else "trainer")
        assert flag(e, "--adapter") == os.path.join(j.run_dir, "run", "adapter") and flag(e, "--quant") == quant
        assert flag(e, "--samples") == "8" and flag(e, "--seed") == str(j.seed)
        assert flag(e, "--limit") == flag(t, "--eval-limit")
    # a subset, and the default step count left to train.py
    sub = exp.build_grid(exp.parse_args(["--seeds", "1", "--algos", "grpo", "--arms", "bf16,nvfp4-aqn-tis"]))
    assert [(j.algo, j.arm.name) for j in sub] == [("grpo", "bf16"), ("grpo", "nvfp4-aqn-tis")]
    assert "--steps" not in sub[0].train_cmd


def test_missing_flags_reads_train_help(monkeypatch):
    jobs = exp.build_grid(exp.parse_args(["--seeds", "1", "--arms", "nvfp4-aqn-sampler"]))
    help_without = "usage: train.py [--quant {nvfp4,bf16}] [--min-lr-ratio R] [--seed SEED]\n  --out OUT  --model M --data D " \
                   "--device D --algo A --eval-every N --eval-limit N --save-every N --plot-every N --log-samples N"
    fake = lambda text: lambda *a, **k: subprocess.CompletedProcess(a, 0, stdout=text, stderr="")
    monkeypatch.setattr(exp.subprocess, "run", fake(help_without))
    assert exp.missing_flags(jobs) == ["--ratio"]  # --min-lr-ratio is not --ratio
    monkeypatch.setattr(exp.subprocess, "run", fake(help_without + "\n  --ratio {sampler,trainer,tis}"))
    assert exp.missing_flags(jobs) == []


# --- aggregation from fake run folders ----------------------------------------------------------

def fake_run(run_dir, reward, h0, final, pass_k, sigma=0.0, steps=4, finished=True):
    """A run folder as train.py, probe.py and eval.py leave it."""
    train_dir = os.path.join(run_dir, exp.TRAIN_DIR)
    os.makedirs(train_dir, exist_ok=True)
    os.makedirs(os.path.join(run_dir, exp.EVAL_DIR), exist_ok=True)
    with open(os.path.join(train_dir, "metrics.jsonl"), "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "entropy": h0 - 0.1 * s, "sigma": sigma * (s > 0), "reward": 0.5}) + "\n")
    with open(os.path.join(run_dir, "probe.jsonl"), "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "completions": 128, "sampled_accuracy": reward + 0.1 * s,
                                "sampler_entropy": h0 + 0.05 - 0.1 * s, "tokens": 1000, "rollouts": 1}) + "\n")
    if finished:
        with open(os.path.join(train_dir, "summary.json"), "w") as f:
            json.dump({"baseline_accuracy": 0.3, "final_accuracy": final, "wall_time_s": 10.0}, f)
        with open(os.path.join(run_dir, exp.EVAL_DIR, "summary.json"), "w") as f:
            json.dump({"pass@k": {str(k): v for k, v in zip(exp.KS, pass_k)}, "seconds": 2.0}, f)


def test_aggregation_from_fake_runs(tmp_path):
    args = exp.parse_args(["--seeds", "3", "--algos", "dapo", "--arms", "bf16,nvfp4-aqn-trainer",
                           "--work", str(tmp_path / "work"), "--first-steps", "2"])
    jobs = exp.build_grid(args)
    base_reward = {0: 0.2, 1: 0.3, 2: 0.4}
    gain = {0: 0.05, 1: 0.10, 2: 0.15}  # nvfp4-aqn minus bf16, per seed
    for j in jobs:
        g = gain[j.seed] if j.arm.name != "bf16" else 0.0
        fake_run(j.run_dir, base_reward[j.seed] + g, 1.0 + g, 0.5 + g, [0.4 + g, 0.6, 0.7, 0.8],
                 sigma=0.01 if "aqn" in j.arm.name else 0.0)
    fake_run(str(tmp_path / "work" / "dapo-bf16-s9"), 0.9, 9.0, 0.9, [0.9] * 4)  # not in the grid: ignored
    rows, curves = exp.collect(jobs, args.first_steps)
    assert len(rows) == 6 and len(curves) == 6
    r = next(r for r in rows if r["arm"] == "bf16" and r["seed"] == 1)
    # probe's sampled accuracy 0.3, 0.4, 0.5, 0.6 over 4 steps: area 0.45, last-5 mean the same
    assert r["reward_auc"] == pytest.approx(0.45) and r["reward_last"] == pytest.approx(0.45)
    assert r["sampler_entropy_0"] == pytest.approx(1.05) and r["sampler_entropy_first"] == pytest.approx(1.0)
    assert r["trainer_entropy_0"] == pytest.approx(1.0) and r["pass@1"] == pytest.approx(0.4)
    assert r["max_sigma"] == 0.0 and r["wall_s"] == pytest.approx(12.0)
    assert next(r for r in rows if r["arm"] != "bf16")["max_sigma"] == pytest.approx(0.01)
    agg = exp.aggregate(rows)
    base, arm = agg[("dapo", "bf16")], agg[("dapo", "nvfp4-aqn-trainer")]
    assert base["n"] == 3 and "vs_baseline" not in base
    assert base["reward_auc"][0] == pytest.approx(0.45)  # seeds' areas 0.35, 0.45, 0.55
    n, m, lo, hi, p = arm["vs_baseline"]["reward_auc"]
    # paired differences 0.05, 0.10, 0.15: mean 0.1, sd 0.05, se 0.05/sqrt(3), all positive -> p = 2/8
    assert n == 3 and m == pytest.approx(0.1)
    assert hi - m == pytest.approx(4.302653 * 0.05 / math.sqrt(3), abs=1e-5)
    assert p == pytest.approx(0.25)
    d = arm["vs_baseline"]["pass@2"]  # equal in both arms: no difference
    assert d[1] == pytest.approx(0.0) and d[4] == pytest.approx(1.0)

    out = tmp_path / "out"
    exp.write_results(str(out), rows, curves, agg, "test settings")
    assert {p.name for p in out.iterdir()} == {"runs.csv", "curves.json", "table.md", "curves.png"}
    lines = (out / "runs.csv").read_text().splitlines()
    assert len(lines) == 7 and lines[0].startswith("algo,arm,seed,")
    table = (out / "table.md").read_text()
    assert "| bf16-LoRA | 3 |" in table and "NVFP4-LoRA + AQN, ratio trainer" in table and "p=0.25" in table
    saved = json.loads((out / "curves.json").read_text())
    assert saved["runs"]["dapo/bf16/0"]["reward"] == pytest.approx([0.2, 0.3, 0.4, 0.5])


def test_unfinished_runs_are_not_collected_and_finished_ones_not_rerun(tmp_path, monkeypatch, capsys):
    args = exp.parse_args(["--seeds", "2", "--algos", "grpo", "--arms", "bf16", "--work", str(tmp_path)])
    done, unfinished = exp.build_grid(args)
    fake_run(done.run_dir, 0.3, 1.0, 0.5, [0.5, 0.6, 0.7, 0.8])
    fake_run(unfinished.run_dir, 0.3, 1.0, 0.5, [0.5, 0.6, 0.7, 0.8], finished=False)
    assert exp.collect_run(unfinished.run_dir, 3) is None
    rows, _ = exp.collect([done, unfinished], 3)
    assert [r["seed"] for r in rows] == [0]
    launched = []
    monkeypatch.setattr(exp, "run_cmd", lambda cmd, log, stop, procs: launched.append(cmd) or 0)
    exp.run_grid([done, unfinished], 2, None)
    # only the unfinished run is trained again (its stale folder cleared first), then evaluated
    assert launched == [unfinished.train_cmd, unfinished.eval_cmd]
    assert os.listdir(unfinished.run_dir) == []  # (run_cmd, faked here, would write the log)
    assert "1 already done, 1 to run" in capsys.readouterr().out


def test_time_limit_kills_and_launches_nothing_more(tmp_path, monkeypatch):
    import sys
    import time

    stop = exp.Stop(deadline=time.time() - 1)  # already past
    procs = set()
    rc = exp.run_cmd([sys.executable, "-c", "import time; time.sleep(60)"], str(tmp_path / "log"), stop, procs)
    assert rc is None and not procs  # killed, and forgotten
    launched = []
    monkeypatch.setattr(exp, "run_cmd", lambda cmd, *a: launched.append(cmd) or 0)
    jobs = exp.build_grid(exp.parse_args(["--seeds", "2", "--algos", "dapo", "--arms", "bf16", "--work", str(tmp_path / "w")]))
    exp.run_grid(jobs, 2, deadline=time.time() - 1)
    assert launched == [] and not any(os.path.exists(j.run_dir) for j in jobs)
