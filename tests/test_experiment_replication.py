"""experiments/aqn_replication.py and experiments/calibrate.py: the statistics against answers known by
construction, the arms' command lines, the pilot's rule, the statement, the collection of run folders,
and the whole pipeline (calibration, pilot, grid, analysis) through the real train.py CLI at a tiny
scale on the CPU (the tiny policy and the arith task stand in for the Countdown policy)."""
import itertools
import json
import math
import os
import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from experiments import aqn_replication as rep
from experiments import calibrate as cal

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- statistics -----------------------------------------------------------------------------------

def test_holm_by_hand():
    # sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1 = 0.02, 0.03, 0.06, 0.04 -> monotone 0.02, 0.03, 0.06, 0.06
    assert rep.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert rep.holm([0.5, 0.6]) == pytest.approx([1.0, 1.0])  # capped at 1
    out = rep.holm([0.01, math.nan, 0.04])  # NaN neither adjusted nor counted
    assert out[0] == pytest.approx(0.02) and math.isnan(out[1]) and out[2] == pytest.approx(0.04)


def test_tost_at_the_critical_value():
    """Differences with mean 0 and standard error 1 over 5 pairs: each one-sided test's t is margin / 1,
    so a margin of t(0.95, 4) = 2.131847 gives p exactly 0.05, a wider one less, a narrower one more."""
    d = np.array([-2.0, -1.0, 0.0, 1.0, 2.0])
    d = d / (d.std(ddof=1) / math.sqrt(5))  # standard error 1
    assert rep.tost(d, 2.131847) == pytest.approx(0.05, abs=1e-5)
    assert rep.tost(d, 4.0) < 0.05 < rep.tost(d, 1.0)
    # an offset mean: the binding side is the nearer margin, t = (margin - |mean|) / se
    assert rep.tost(d + 0.5, 2.631847) == pytest.approx(0.05, abs=1e-5)
    assert math.isnan(rep.tost([0.1], 1.0)) and math.isnan(rep.tost([0.1, 0.1], 1.0))


def test_sign_flip_p_exact_by_enumeration():
    rng = random.Random(3)
    d = [rng.uniform(-1, 2) for _ in range(8)]
    obs = abs(sum(d))
    count = sum(abs(sum(s * x for s, x in zip(signs, d))) >= obs - 1e-12 for signs in itertools.product((1, -1), repeat=8))
    assert rep.sign_flip_p(d) == pytest.approx(count / 256)
    assert rep.sign_flip_p([0.3] * 8) == pytest.approx(2 / 256)  # 8 seeds, all one way: the smallest p


def test_detectable_difference_by_hand():
    # from a t table: t(0.995, 7) = 3.4995, t(0.99, 7) = 2.9980, t(0.8, 7) = 0.8960
    assert rep.detectable(0.02, 8, alpha=0.01) == pytest.approx((3.4995 + 0.8960) * 0.02 / math.sqrt(8), rel=1e-3)
    # the default alpha 0.05 / 4 (two-sided: t at 0.99375) lies between the 0.99 and 0.995 quantiles
    assert (2.9980 + 0.8960) * 0.02 / math.sqrt(8) < rep.detectable(0.02, 8) < (3.4995 + 0.8960) * 0.02 / math.sqrt(8)
    assert math.isnan(rep.detectable(0.02, 1))


def test_contrast_pairs_on_common_seeds():
    row = lambda v: {"heldout_pass1": v}  # noqa: E731
    a = {0: row(0.30), 1: row(0.35), 2: row(0.32), 3: row(0.40)}
    b = {0: row(0.20), 1: row(0.25), 2: row(0.22), 9: row(0.9)}
    c = rep.contrast(a, b, "heldout_pass1")
    assert c["n"] == 3 and c["mean"] == pytest.approx(0.1) and c["diffs"] == pytest.approx([0.1, 0.1, 0.1])
    assert c["p"] == pytest.approx(0.25) and c["sd"] == pytest.approx(0.0, abs=1e-12)


# --- command lines -------------------------------------------------------------------------------

CAL = {"sigma_star": 0.034, "tau_star": 1.03, "tau_hot": 1.25}


def flag(cmd, name):
    return cmd[cmd.index(name) + 1]


def test_grid_is_every_arm_on_every_seed(tmp_path):
    jobs = rep.grid_jobs(str(tmp_path), CAL, 5e-4)  # the first design's arms, 1-6
    assert len(jobs) == len(rep.FIRST_ARMS) * len(rep.SEEDS) == 48 and len({j.run_dir for j in jobs}) == 48
    assert [j.seed for j in jobs[:6]] == [0] * 6  # seed by seed
    for j in jobs:
        train, ev, ent = (cmd for _, cmd in j.stages)
        assert train[1:4] == ["experiments/aqn_replication.py", "tap", j.run_dir] and train[4] == "--"
        assert flag(train, "--seed") == str(j.seed) and flag(train, "--lr") == "0.0005"
        assert flag(train, "--steps") == str(rep.STEPS) and flag(train, "--aqn-stages") == "10"
        assert rep.STEPS // int(flag(train, "--aqn-stages")) >= 10  # AQN stages of at least 10 steps
        quant = flag(train, "--quant")
        assert quant == ("nvfp4" if j.arm.number in (2, 3, 4) else "bf16")
        assert ("--no-aqn" in train) == (not j.arm.noise) == (j.arm.number not in (3, 4))
        if j.arm.number == 3:
            assert (flag(train, "--sigma-start"), flag(train, "--sigma-end")) == ("1e-2", "1e-4")
        if j.arm.number == 4:
            assert float(flag(train, "--sigma-start")) == pytest.approx(0.034)
            assert float(flag(train, "--sigma-end")) == pytest.approx(0.00034)
        if j.arm.number in (5, 6):
            assert float(flag(train, "--temperature")) == {5: 1.03, 6: 1.25}[j.arm.number]
        else:
            assert "--temperature" not in train
        assert "--train-temperature" not in train  # the trainer scores at the sampling temperature (TRL's way)
        assert ev[1] == "eval.py" and flag(ev, "--quant") == quant and flag(ev, "--samples") == "16"
        assert flag(ev, "--limit") == "512" and flag(ev, "--temperature") == "1.0"
        assert flag(ev, "--adapter") == os.path.join(j.run_dir, "run", "adapter") and flag(ev, "--seed") == str(j.seed)
        assert ent[1:3] == ["experiments/calibrate.py", "entropy"] and flag(ent, "--quant") == quant
        assert flag(ent, "--prompts") == flag(train, "--eval-limit")


def test_overrides_and_the_pilot(tmp_path):
    flags = rep.common_flags("--model tiny --steps 3 --no-compile --fp8-update", lr=1e-3)
    assert flags["--model"] == "tiny" and flags["--steps"] == "3" and flags["--lr"] == "0.001"
    assert flags["--no-compile"] is None and flags["--fp8-update"] is None and flags["--data"] == "countdown"
    with pytest.raises(ValueError, match="expected a flag"):
        rep.parse_flags("tiny --steps 3")
    with pytest.raises(ValueError, match="needs calibration.json"):
        rep.grid_jobs(str(tmp_path), None, 1e-3)
    jobs = rep.pilot_jobs(str(tmp_path), "--steps 7")
    assert len(jobs) == len(rep.PILOT_LRS) * len(rep.PILOT_SEEDS)
    assert not set(rep.PILOT_SEEDS) & set(rep.SEEDS)  # the grid's seeds stay untouched
    for j in jobs:
        assert [s for s, _ in j.stages] == ["train"] and j.arm.number == 1
        assert float(flag(j.stages[0][1], "--lr")) == j.lr and flag(j.stages[0][1], "--steps") == "7"


def test_the_hard_problems_run_through_every_stage(tmp_path):
    """--override='--data countdown-hard --eval-data countdown-hard' (the fourth grid): train.py, eval.py and the
    teacher-forced entropy all read the hard problems; a set that is no synthetic task or subset is refused."""
    hard = rep.common_flags("--data countdown-hard --eval-data countdown-hard", lr=5e-4)
    assert rep.task_name(hard) == "countdown-hard"
    job = rep.make_job("x", None, 0, 5e-4, ["--data", "countdown-hard", "--quant", "bf16"], hard, str(tmp_path))
    train, ev, ent = (cmd for _, cmd in job.stages)
    assert flag(train, "--data") == flag(ev, "--data") == flag(ent, "--data") == "countdown-hard"
    with pytest.raises(ValueError, match="countdown-hard"):
        rep.task_name(rep.common_flags("--eval-data gsm8k", lr=5e-4))


def test_dry_run_before_calibration_shows_placeholders(tmp_path, capsys):
    jobs = rep.main(["grid", "--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "w"), "--seeds", "1"])
    assert len(jobs) == len(rep.FIRST_ARMS) and not (tmp_path / "w").exists()  # nothing run, nothing written
    out = capsys.readouterr().out
    assert "--sigma-start {sigma_star}" in out and "--temperature {tau_hot}" in out and "--lr {lr}" in out
    (tmp_path / "calibration.json").write_text(json.dumps(CAL))
    jobs = rep.main(["grid", "--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "w"), "--seeds", "2",
                     "--arms", "1,6", "--tau-hot", "1.5", "--override=--lr 5e-4"])
    assert [(j.arm.number, j.seed) for j in jobs] == [(1, 0), (6, 0), (1, 1), (6, 1)]
    assert {flag(j.stages[0][1], "--temperature") for j in jobs if j.arm.number == 6} == {"1.5"}
    assert {flag(j.stages[0][1], "--lr") for j in jobs} == {"0.0005"}


def test_sampler_only_controls_and_bad_arm_numbers(tmp_path, capsys):
    """Arms 7 and 8 are arms 5 and 6 with the update scoring at T = 1 (the temperature on the sampler alone, as
    AQN's noise); arm 9 samples 16 a prompt; they run only when named, and unknown arm numbers are refused
    before anything runs."""
    (tmp_path / "calibration.json").write_text(json.dumps(CAL))
    jobs = rep.main(["grid", "--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "w"), "--seeds", "1",
                     "--arms", "5,6,7,8", "--override=--lr 5e-4"])
    train = {j.arm.number: j.stages[0][1] for j in jobs}
    for sampler_only, both in ((7, 5), (8, 6)):
        assert flag(train[sampler_only], "--temperature") == flag(train[both], "--temperature")
        assert flag(train[sampler_only], "--train-temperature") == "1" and "--train-temperature" not in train[both]
    assert len({j.run_dir for j in jobs}) == 4  # their own folders: a work folder can hold both designs
    # arm 9: arm 1 with 16 samples a prompt; its --group-size comes after COMMON's 8, so train.py takes it
    g16 = rep.main(["grid", "--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "w"), "--seeds", "1",
                    "--arms", "9", "--override=--lr 5e-4"])[0].stages[0][1]
    import recipes

    parsed = recipes.parse(g16[g16.index("--") + 1:])  # (train.py's own reading of the run's flags)
    assert parsed.group_size == 16 and parsed.quant == "bf16" and not parsed.aqn
    with pytest.raises(SystemExit, match="no arm 12"):
        rep.main(["grid", "--dry-run", "--out", str(tmp_path), "--work", str(tmp_path / "w"), "--arms", "1,12"])
    with pytest.raises(SystemExit):
        rep.parse_args(["analyze", "--controls", "5"])
    assert "give two arm numbers" in capsys.readouterr().err


def test_missing_flags_are_found(monkeypatch):
    jobs = rep.grid_jobs("/tmp/w", CAL, 1e-3, seeds=(0,))
    assert rep.missing_flags(jobs) == []  # train.py as it is knows every flag the arms use
    fake = subprocess.CompletedProcess([], 0, stdout="usage: train.py --quant --seed --out --lr", stderr="")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: fake)
    assert "--no-aqn" in rep.missing_flags(jobs) and "--lr" not in rep.missing_flags(jobs)


# --- the pilot's rule ----------------------------------------------------------------------------

def test_choose_lr_takes_the_largest_that_keeps_its_entropy():
    steps = 30
    flat = [1.0] * steps
    late = [1.0] * 15 + [0.3] * 15  # collapses after the first third
    early = [1.0] * 5 + [0.3] * 25  # collapses within it
    lr, collapse = rep.choose_lr({1e-4: [flat, flat], 5e-4: [late, late], 2e-3: [early, early]}, steps)
    assert lr == 5e-4 and collapse[1e-4] is None and collapse[2e-3] < 10 <= collapse[5e-4]
    # the seed mean decides: one collapsing seed and one flat stay above half their start
    assert rep.choose_lr({1e-3: [early, flat]}, steps)[1][1e-3] is None
    assert rep.choose_lr({1e-3: [early], 2e-3: [early]}, steps)[0] == 1e-3  # none qualifies: the smallest


# --- the statement ---------------------------------------------------------------------------------

def fake_rows(effects, n=8, noise=0.01, seed=0):
    """Rows of arms 1-8 on n seeds: a seed effect shared by all arms, each arm's effect on each metric, and
    small independent noise."""
    rng = np.random.default_rng(seed)
    rows = []
    base = rng.normal(0.3, 0.05, n)
    for arm in range(1, 9):
        for s in range(n):
            e = effects.get(arm, {})
            rows.append({"arm": arm, "seed": s,
                         "reward_area": base[s] + e.get("reward_area", 0) + rng.normal(0, noise),
                         "heldout_pass1": base[s] + e.get("heldout_pass1", 0) + rng.normal(0, noise),
                         "sampler_entropy_early": 0.8 + e.get("entropy", 0) + rng.normal(0, noise)})
    return rows


def test_statement_supports_refutes_and_inconclusive():
    up = {"heldout_pass1": 0.08, "reward_area": 0.08, "entropy": 0.1}
    verdict, reasons = rep.statement(rep.analyze(fake_rows({6: up, 4: up, 5: {"heldout_pass1": 0.04}})))
    assert verdict == "supports", reasons
    verdict, _ = rep.statement(rep.analyze(fake_rows({6: up}, noise=0.002)))  # 2 and 4 equal to 1, tightly
    assert verdict == "refutes at this scale"
    verdict, _ = rep.statement(rep.analyze(fake_rows({4: up})))  # the positive control does nothing
    assert verdict == "inconclusive (positive control failed)"
    verdict, _ = rep.statement(rep.analyze(fake_rows({6: up, 4: {"heldout_pass1": 0.08}})))  # better, entropy not up
    assert verdict == "inconclusive"
    verdict, reasons = rep.statement(rep.analyze(fake_rows({6: up, 4: up, 5: {"heldout_pass1": 0.2}})))  # 5 beats 4
    assert verdict == "inconclusive" and "4-5 not significantly negative on either primary: no" in reasons


def test_statement_with_the_sampler_only_controls():
    """--controls 7,8: the positive control is 8-1 and the entropy-matched one 4-7; arm 6's effect then counts
    for nothing, and arm 7 beating arm 4 is what blocks 'supports'."""
    up = {"heldout_pass1": 0.08, "reward_area": 0.08, "entropy": 0.1}
    assert rep.planned((7, 8)) == ((2, 1), (4, 1), (4, 7), (8, 1)) and rep.planned() == rep.CONTRASTS
    res = rep.analyze(fake_rows({8: up, 4: up}), controls=(7, 8))
    assert set(res["contrasts"]) == set(rep.planned((7, 8)))
    verdict, reasons = rep.statement(res)
    assert verdict == "supports" and reasons[0].startswith("positive control (8-1"), reasons
    assert rep.statement(rep.analyze(fake_rows({6: up, 4: up}), controls=(7, 8)))[0] == \
        "inconclusive (positive control failed)"
    verdict, reasons = rep.statement(rep.analyze(fake_rows({8: up, 4: up, 7: {"heldout_pass1": 0.2}}), controls=(7, 8)))
    assert verdict == "inconclusive" and "4-7 not significantly negative on either primary: no" in reasons


def test_mps_falls_back_and_cleans_up(tmp_path, monkeypatch, capsys):
    """--mps where the daemon is missing, or starts but no CUDA client can use it (this CPU machine): the runs
    go on without it, the daemon is told to quit, and the environment is as before."""
    with rep.mps(False) as on:
        assert on is False
    monkeypatch.setattr(rep.shutil, "which", lambda name: None)
    with rep.mps(True) as on:
        assert on is False and "not found" in capsys.readouterr().out
    log = tmp_path / "calls.log"  # a stand-in daemon control: records its arguments and stdin, always succeeds
    fake = tmp_path / "nvidia-cuda-mps-control"
    fake.write_text(f"#!/bin/sh\necho \"args:$*\" >> {log}\nif [ -z \"$1\" ]; then cat >> {log}; fi\n")
    fake.chmod(0o755)
    monkeypatch.setattr(rep.shutil, "which", lambda name: str(fake))
    monkeypatch.setattr(rep.sys, "executable", sys.executable)
    monkeypatch.setenv("PYTHONPATH", "")
    before = dict(os.environ)
    client_works = torch.cuda.is_available()
    with rep.mps(True) as on:
        assert on is client_works
    calls = log.read_text()
    assert "args:-d" in calls and "quit" in calls  # started, then told to quit
    assert dict(os.environ) == before
    if not client_works:
        assert "a CUDA client failed" in capsys.readouterr().out


def test_analysis_holm_over_the_four_contrasts():
    res = rep.analyze(fake_rows({6: {"heldout_pass1": 0.08}}))
    cs = res["contrasts"]
    assert set(cs) == set(rep.CONTRASTS)
    ps = [cs[c]["heldout_pass1"]["p"] for c in rep.CONTRASTS]
    assert [cs[c]["heldout_pass1"]["holm"] for c in rep.CONTRASTS] == pytest.approx(rep.holm(ps))
    assert cs[(6, 1)]["heldout_pass1"]["p"] == pytest.approx(2 / 256)  # all 8 pairs positive
    assert "holm" not in cs[(6, 1)]["sampler_entropy_early"]  # secondaries: unadjusted


# --- collecting run folders -------------------------------------------------------------------------

def fake_run(job, sigma, reward, steps=4, probes=((0, [0, 0, 1]), (2, [0, 2, 1]), (4, [1, 2, 1]))):
    """A finished run's folder as the tap, train.py, eval.py and calibrate.py leave it."""
    run = job.run_dir
    os.makedirs(os.path.join(run, "run"), exist_ok=True)
    os.makedirs(os.path.join(run, "eval"), exist_ok=True)
    with open(os.path.join(run, "run", "metrics.jsonl"), "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "sigma": sigma * (s > 0), "entropy": 0.5, "mismatch_kl": 1e-3 * s,
                                "time_step": 2.0}) + "\n")
    with open(os.path.join(run, "probe.jsonl"), "w") as f:
        for s in range(steps):
            f.write(json.dumps({"step": s, "sampled_accuracy": reward + 0.1 * s, "sampler_entropy": 1.0 - 0.1 * s}) + "\n")
    with open(os.path.join(run, "heldout.jsonl"), "w") as f:
        for after, correct in probes:
            f.write(json.dumps({"after_steps": after, "samples": 2, "correct": correct}) + "\n")
    for path, obj in (("run/summary.json", {"baseline_accuracy": 0.1, "final_accuracy": 0.2, "wall_time_s": 30.0}),
                      ("eval/summary.json", {"accuracy": 0.25, "pass@k": {"1": 0.25, "2": 0.4, "4": 0.5}, "seconds": 3}),
                      ("tf_entropy.json", {"tf_entropy": 0.7}), ("done.json", {})):
        with open(os.path.join(run, path), "w") as f:
            json.dump(obj, f)


def test_collect_rows_by_hand_and_drop_contradicting_noise(tmp_path):
    jobs = rep.grid_jobs(str(tmp_path), CAL, 1e-3, seeds=(0,), arms=[rep.ARMS[0], rep.ARMS[3]])
    fake_run(jobs[0], 0.0, 0.2)
    fake_run(jobs[1], 0.0, 0.2)  # arm 4 without noise: contradicts its arm
    rows, curves, dropped = rep.collect(jobs)
    assert [r["arm"] for r in rows] == [1] and len(dropped) == 1 and "arm 4 is with AQN" in dropped[0]
    r = rows[0]
    assert r["reward_area"] == pytest.approx(np.mean([0.2, 0.3, 0.4, 0.5]))
    assert r["sampler_entropy_early"] == pytest.approx(np.mean([1.0, 0.9]))  # the first ceil(4 / 3) = 2 steps
    # first solves: problem 0 after 4 steps, 1 after 2, 2 at 0; none censored
    assert r["first_solve"] == pytest.approx(2.0) and r["solved_frac"] == 1.0
    assert r["probe_area"] == pytest.approx(np.mean([1 / 6, 3 / 6, 4 / 6]))
    assert r["heldout_pass1"] == 0.25 and r["pass@2"] == 0.4 and r["pass@4"] == 0.5 and "pass@1" not in r
    assert r["tf_entropy"] == 0.7 and r["mismatch_kl"] == pytest.approx(1.5e-3) and r["step_s"] == 2.0
    assert curves["1/0"]["probe_step"] == [0, 2, 4]
    first, solved = rep.first_solves([{"after_steps": 0, "correct": [0, 1]}, {"after_steps": 5, "correct": [0, 1]}], 10)
    assert first == [15, 0] and solved == 0.5  # never solved: censored one interval past the end


def test_finish_keeps_counts_and_drops_the_bulk(tmp_path):
    job = rep.grid_jobs(str(tmp_path), CAL, 1e-3, seeds=(0,), arms=[rep.ARMS[0]])[0]
    os.makedirs(os.path.join(job.run_dir, "run", "adapter"))
    os.makedirs(os.path.join(job.run_dir, "run", "checkpoint"))
    os.makedirs(os.path.join(job.run_dir, "eval"))
    open(os.path.join(job.run_dir, "run", "curves.png"), "wb").close()
    with open(os.path.join(job.run_dir, "eval", "samples.jsonl"), "w") as f:
        for i, c in [(0, True), (0, False), (1, True), (1, True), (2, False), (2, False)]:
            f.write(json.dumps({"index": i, "correct": c}) + "\n")
    rep.finish(job)
    assert sorted(os.listdir(os.path.join(job.run_dir, "run"))) == []
    assert json.load(open(os.path.join(job.run_dir, "eval", "per_item.json"))) == [1, 2, 0]
    assert rep.done(job.run_dir) and not os.path.exists(os.path.join(job.run_dir, "eval", "samples.jsonl"))


def test_readme_blocks_and_pack(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("design\n<!-- BEGIN results -->\nnot run yet\n<!-- END results -->\nafter\n")
    rep.fill_readme(str(readme), {"results": "| a | b |"})
    assert readme.read_text() == "design\n<!-- BEGIN results -->\n| a | b |\n<!-- END results -->\nafter\n"
    with pytest.raises(ValueError, match="no <!-- BEGIN pilot -->"):
        rep.fill_readme(str(readme), {"pilot": "x"})
    src = tmp_path / "src"
    src.mkdir()
    (src / "big.bin").write_bytes(os.urandom(300_000))  # (random bytes do not compress)
    for run in ("finished", "unfinished"):  # the unfinished run is left out, however big
        (src / run / "run" / "checkpoint").mkdir(parents=True)
        (src / run / "train.log").write_text("")
    (src / "unfinished" / "run" / "checkpoint" / "state.pt").write_bytes(os.urandom(300_000))
    (src / "finished" / "done.json").write_text("{}")
    parts = rep.pack(["src", "absent"], str(tmp_path / "out"), "x", part_mib=0.1, root=str(tmp_path))
    assert len(parts) == 3 and all(os.path.getsize(p) <= 0.1 * 2**20 for p in parts)
    unpacked = tmp_path / "unpacked"
    unpacked.mkdir()
    subprocess.run(f"cat {' '.join(parts)} | tar xzf - -C {unpacked}", shell=True, check=True)
    assert (unpacked / "src" / "big.bin").read_bytes() == (src / "big.bin").read_bytes()
    assert sorted(os.listdir(unpacked / "src")) == ["big.bin", "finished"]


def test_a_cut_run_resumes_from_its_checkpoint_as_if_never_cut(tmp_path):
    """A run stopped after its checkpoint at step 2 of 4 (its taps' records already past it) continues with
    train.py --resume: the records are cut back and written again, and equal those of the run never cut
    (train.py's resume is exact, one CPU thread a run); without a checkpoint it starts from scratch."""
    override = ("--model tiny --data arith --eval-data arith --device cpu --steps 4 --prompts 2 --group-size 4 "
                "--max-new-tokens 24 --eval-limit 3 --eval-samples 2 --eval-every 2 --save-every 2")
    common = rep.common_flags(override, lr=1e-3)

    def job(name):
        return rep.make_job(name, rep.ARMS[0], 0, 1e-3, rep.flag_list(common) + rep.arm_flags(rep.ARMS[0], None),
                            common, str(tmp_path), final=False)

    whole, cut = job("whole"), job("cut")
    stop = rep.Stop(None)
    assert rep.run_job(whole, stop, set(), keep_adapters=True)[0].startswith("done")
    # the cut run: the whole run's folder as it stood after a kill during step 4 (checkpoint/ of step 4
    # gone, checkpoint.old/ of step 2 newest), its taps' records running past it
    import shutil

    shutil.copytree(whole.run_dir, cut.run_dir)
    for name in ("done.json", "run/summary.json", "run/adapter", "run/checkpoint"):
        path = os.path.join(cut.run_dir, name)
        shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    assert rep.run_job(cut, stop, set())[0].startswith("done")
    assert os.path.exists(os.path.join(cut.run_dir, "train.resumed-1.log"))
    assert "resumed" in open(os.path.join(cut.run_dir, "train.resumed-1.log")).read()
    for name in ("probe.jsonl", "heldout.jsonl", "run/metrics.jsonl"):
        a, b = (rep.read_jsonl(os.path.join(j.run_dir, name)) for j in (whole, cut))
        drop = ("time", "wall", "_s", "memory")  # (timings and memory differ; what the analysis reads must not)
        same = [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in a]
        assert same == [{k: v for k, v in r.items() if not any(d in k for d in drop)} for r in b], name
    assert [h["after_steps"] for h in rep.read_jsonl(os.path.join(cut.run_dir, "heldout.jsonl"))] == [0, 2, 4]
    assert all(m["groups"] > 0 for m in b[2:])  # (the resumed steps trained: the optimizer's state mattered)
    # no checkpoint: the folder is cleared and the run starts again
    fresh = job("fresh")
    os.makedirs(os.path.join(fresh.run_dir, "run"))
    open(os.path.join(fresh.run_dir, "probe.jsonl"), "w").write('{"stale": 1}\n')
    assert rep.run_job(fresh, stop, set())[0].startswith("done")
    assert not os.path.exists(os.path.join(fresh.run_dir, "train.resumed-1.log"))
    assert len(rep.read_jsonl(os.path.join(fresh.run_dir, "probe.jsonl"))) == 4


def test_runs_out_of_gpu_memory_run_again_fewer_at_a_time(tmp_path, capsys):
    """A run whose training fails for want of GPU memory (too many sharing one card) runs again after the
    others, half as many at a time, until one at a time; a run failing for a reason of its own does not."""
    tries = tmp_path / "tries"
    tries.mkdir()
    script = ("import os, sys; name, ooms, run = sys.argv[1], int(sys.argv[2]), sys.argv[3]\n"
              f"log = os.path.join({str(tries)!r}, name)\n"
              "n = len(open(log).read()) if os.path.exists(log) else 0\n"
              "open(log, 'a').write('x')\n"
              "if ooms < 0: sys.exit('ValueError: a bug of its own')\n"
              "if n < ooms: sys.exit('RuntimeError: CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate')\n"
              "os.makedirs(os.path.join(run, 'run')); open(os.path.join(run, 'run', 'summary.json'), 'w').write('{}')\n")

    def job(name, ooms):
        run = str(tmp_path / "work" / name)
        return rep.Job(name, None, 0, 1e-3, run, [("train", [sys.executable, "-c", script, name, str(ooms), run])])

    jobs = [job("fine", 0), job("once", 1), job("bug", -1), job("always", 99)]
    rep.run_all(jobs, 4, None)
    tried = {j.name: len((tries / j.name).read_text()) for j in jobs}
    assert tried == {"fine": 1, "once": 2, "bug": 1, "always": 3}  # 4 at a time, then 2, then 1
    assert [rep.done(j.run_dir) for j in jobs] == [True, True, False, False]
    out = capsys.readouterr().out
    assert "2 run(s) ran out of GPU memory: running them again, 2 at a time" in out
    assert "1 run(s) ran out of GPU memory: running them again, 1 at a time" in out
    assert "FAILED rc=1 (out of GPU memory)" in out and "bug: train FAILED rc=1: see" in out


# --- the raw records kept in the repository --------------------------------------------------------

def analyze_into(out, work, *extra):
    """`analyze` on run folders or a keep archive, into `out` (which needs only calibration.json)."""
    rep.main(["analyze", "--work", str(work), "--out", str(out), *extra])
    return {name: (out / name).read_text() for name in ("runs.csv", "table.md", "curves.json")}


def test_keep_archives_the_records_and_analyze_reads_them_back(tmp_path):
    """keep() writes what the analysis reads and nothing bulky; analyze on the archive gives the same
    files as on the folders; a changed record changes both the archive's bytes and the results."""
    work, out_dir, out_tar = tmp_path / "work", tmp_path / "a", tmp_path / "b"
    jobs = rep.grid_jobs(str(work), CAL, 1e-3, seeds=(0, 1), arms=[rep.ARMS[0], rep.ARMS[5]])
    for k, j in enumerate(jobs):
        fake_run(j, 0.0, 0.1 + 0.05 * k)
        os.makedirs(os.path.join(j.run_dir, "run", "adapter"))
        for bulky in ("train.log", "run/samples.jsonl", "run/adapter/adapter_model.safetensors"):
            with open(os.path.join(j.run_dir, bulky), "w") as f:
                f.write("x" * 1000)
    os.makedirs(work / "unfinished" / "run")  # no done.json: not kept
    for out in (out_dir, out_tar):
        out.mkdir()
        (out / "calibration.json").write_text(json.dumps(CAL))
    archive = tmp_path / "runs.tar.gz"
    assert rep.keep(str(work), str(archive)) == 4
    import tarfile

    with tarfile.open(archive) as tar:
        names = sorted(tar.getnames())
    kept = ("done.json", "probe.jsonl", "heldout.jsonl", "tf_entropy.json", "run/metrics.jsonl", "run/summary.json",
            "eval/summary.json")  # what fake_run writes of KEEP
    assert names == sorted(f"{os.path.basename(j.run_dir)}/{k}" for j in jobs for k in kept)
    flags = ["--seeds", "2", "--arms", "1,6", "--override=--lr 1e-3"]
    from_folders = analyze_into(out_dir, work, *flags)
    assert analyze_into(out_tar, archive, *flags) == from_folders
    assert (out_tar / "paired.png").exists() and not (out_tar / "pilot.json").exists()  # no pilot runs here
    first = archive.read_bytes()
    rep.keep(str(work), str(archive))
    assert archive.read_bytes() == first  # the same records, the same bytes
    probe = os.path.join(jobs[0].run_dir, "probe.jsonl")
    lines = open(probe).read().replace('"sampled_accuracy": 0.1,', '"sampled_accuracy": 0.9,', 1)
    open(probe, "w").write(lines)
    rep.keep(str(work), str(archive))
    assert archive.read_bytes() != first
    assert analyze_into(out_tar, archive, *flags)["runs.csv"] != from_folders["runs.csv"]
    with pytest.raises(SystemExit, match="only analyze"):
        rep.main(["grid", "--work", str(archive), "--out", str(out_tar)])


HARD = "--override=--lr 5e-4 --data countdown-hard --eval-data countdown-hard --save-every 10"
GRIDS = {  # each grid's analyze flags, as its README gives them
    "aqn_replication": [],
    "aqn_replication_2": ["--arms", "1,2,4,5,6", "--seeds", "24", "--tau-hot", "1.5", "--override=--lr 5e-4"],
    "aqn_replication_3": ["--arms", "1,2,4,7,8", "--controls", "7,8", "--seeds", "24", "--tau-hot", "1.5",
                          "--override=--lr 5e-4"],
    "aqn_replication_4": ["--arms", "1,2,4,7,8", "--controls", "7,8", "--seeds", "24", "--tau-hot", "1.5", HARD],
    "aqn_replication_5": ["--arms", "1,2,4,7,8,9", "--controls", "7,9", "--seeds", "24", "--tau-hot", "1.5", HARD],
}


@pytest.mark.parametrize("grid", sorted(GRIDS))
def test_kept_records_recompute_the_committed_results(tmp_path, grid):
    """Each grid's committed archive of raw records (results/<grid>/runs.tar.gz; the first grid's holds the
    pilot's too) gives back, through `analyze` with the flags its README gives, the committed runs.csv,
    table.md, curves.json (and pilot.json) byte for byte, and the README's results block is the table: no
    number in those tables was written by hand."""
    res = os.path.join(ROOT, "results", grid)
    out = tmp_path / "out"
    out.mkdir()
    (out / "calibration.json").write_bytes(open(os.path.join(res, "calibration.json"), "rb").read())
    got = analyze_into(out, os.path.join(res, "runs.tar.gz"), *GRIDS[grid])
    for name in ("runs.csv", "table.md", "curves.json"):
        assert got[name] == open(os.path.join(res, name)).read(), name
    if grid == "aqn_replication":  # (the later grids took the first one's lr)
        assert (out / "pilot.json").read_text() == open(os.path.join(res, "pilot.json")).read()
    readme = open(os.path.join(res, "README.md")).read()
    block = readme.split("<!-- BEGIN results -->\n", 1)[1].split("<!-- END results -->", 1)[0]
    assert block.strip() == got["table.md"].split("\n", 2)[2].strip()


# --- calibration --------------------------------------------------------------------------------

def test_kl_entropy_and_crossings_by_hand():
    p = torch.tensor([[0.0, 0.0]])  # uniform over 2
    q = torch.tensor([[math.log(3.0), 0.0]])  # (3/4, 1/4)
    kl, h = cal.kl_entropy(p, q)
    assert kl == pytest.approx(0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25))
    assert h == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert cal.entropy(p) == pytest.approx(math.log(2))
    # KL = sigma^2 on the grid: the crossing of 4e-4 is sigma 2e-2, inside; 1e-8 is 1e-4, extrapolated
    xs = (1e-3, 1e-2, 1e-1)
    assert cal.cross(xs, [x * x for x in xs], 4e-4) == (pytest.approx(2e-2), True)
    assert cal.cross(xs, [x * x for x in xs], 1e-8) == (pytest.approx(1e-4), False)
    logits = torch.randn(50, 7)
    target = cal.entropy(logits, 1.3)
    assert cal.solve_tau(logits, target) == pytest.approx(1.3, abs=1e-6)


def test_weight_error_is_zero_where_nvfp4_is_exact(hf_folder):
    """A constant block quantizes exactly (its amax maps to E2M1's 6 under an exact FP8 scale): error 0;
    random weights in one projection give that projection the random matrix's error, and "all" the
    Frobenius mix of the two."""
    import model

    _, folder = hf_folder("qwen2")
    m = model.Transformer.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for name, lin in m.named_modules():
            if isinstance(lin, torch.nn.Linear) and name.split(".")[-1] in ("q_proj", "up_proj"):
                lin.weight.fill_(0.01)
    err = cal.weight_error(m)
    assert err["q_proj"] == 0.0 and err["up_proj"] == 0.0 and 0 < err["all"] < err["down_proj"]
    w = m.layers[0].mlp.down_proj.weight
    assert err["down_proj"] == pytest.approx(cal.random_weight_error(tuple(w.shape), seed=0), rel=0.1)  # (both Gaussian)


def test_pack_marks_the_completion_positions():
    tokens, mask = cal.pack([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0)
    assert tokens.tolist() == [[1, 2, 3, 5, 6], [4, 7, 8, 9, 0]]
    # position t predicts token t + 1: the completion's tokens are predicted from its prompt's last position on
    assert mask.tolist() == [[False, False, True, True, False], [True, True, True, False, False]]


# --- the whole pipeline, tiny, on the CPU ---------------------------------------------------------

def test_pipeline_end_to_end_on_the_tiny_policy(tmp_path):
    """calibrate.py, the pilot (2 lrs, 1 seed), a 2-arm x 2-seed grid of 2-step runs through the real
    train.py, eval.py and calibrate.py CLIs, then the analysis filling a README's blocks: every file
    written, every run's metrics finite, the AQN arm's noise logged, the bf16 arm's absent."""
    out, work = tmp_path / "out", tmp_path / "work"
    py = [sys.executable]
    subprocess.run(py + ["experiments/calibrate.py", "--model", "tiny", "--data", "arith", "--prompts", "6",
                         "--max-new-tokens", "24", "--device", "cpu", "--draws", "1", "--sigmas", "1e-2,1e-1",
                         "--out", str(out)], cwd=ROOT, check=True, capture_output=True)
    c = json.loads((out / "calibration.json").read_text())
    assert c["sigma_star"] > 0 and c["tau_hot"] >= cal.TAU_HOT_MIN and 0 < c["weight_error"]["all"] < 0.5
    rows = (out / "calibration.csv").read_text().splitlines()
    assert rows[0].startswith("source,parameter,kl,entropy") and len(rows) == 1 + 2 + 2 * 2 + len(cal.TAUS) + 1
    override = ("--model tiny --data arith --eval-data arith --device cpu --steps 2 --prompts 2 --group-size 2 "
                "--max-new-tokens 24 --eval-limit 3 --eval-samples 2 --eval-every 1")
    common = ["--out", str(out), "--work", str(work), "--jobs", "2", f"--override={override}"]
    r = subprocess.run(py + ["experiments/aqn_replication.py", "pilot", "--pilot-lrs", "1e-3,2e-3", "--pilot-seeds", "1000",
                             *common], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    pilot = json.loads((out / "pilot.json").read_text())
    assert pilot["complete"] and pilot["lr"] in (1e-3, 2e-3) and set(pilot["per_lr"]) == {"0.001", "0.002"}
    (out / "README.md").write_text("design\n<!-- BEGIN calibration -->\n<!-- END calibration -->\n"
                                   "<!-- BEGIN pilot -->\n<!-- END pilot -->\n<!-- BEGIN results -->\n<!-- END results -->\n")
    r = subprocess.run(py + ["experiments/aqn_replication.py", "grid", "--arms", "1,4", "--seeds", "2",
                             "--final-items", "3", "--final-samples", "2", *common], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "4/4 runs finished" in r.stdout
    import csv

    runs = list(csv.DictReader(open(out / "runs.csv")))
    assert sorted((int(x["arm"]), int(x["seed"])) for x in runs) == [(1, 0), (1, 1), (4, 0), (4, 1)]
    for x in runs:
        for k in ("reward_area", "heldout_pass1", "pass@2", "first_solve", "tf_entropy", "sampler_entropy_early",
                  "mismatch_kl"):
            assert math.isfinite(float(x[k])), (k, x)
        assert (float(x["max_sigma"]) > 0) == (x["arm"] == "4")
        assert float(x["lr"]) == pilot["lr"]
    heldout = [json.loads(line) for line in open(work / "1-bf16-s0" / "heldout.jsonl")]
    assert [h["after_steps"] for h in heldout] == [0, 1, 2]  # the baseline, the probe after step 1, the final
    assert all(len(h["correct"]) == 3 and h["samples"] == 2 for h in heldout)
    readme = (out / "README.md").read_text()
    assert "sigma* =" in readme and "Chosen lr" in readme and "## Statement: **" in readme
    assert {p.name for p in out.iterdir()} >= {"runs.csv", "curves.json", "curves.png", "paired.png", "table.md"}
    # a second call finds everything done and launches nothing
    r = subprocess.run(py + ["experiments/aqn_replication.py", "grid", "--arms", "1,4", "--seeds", "2",
                             "--final-items", "3", "--final-samples", "2", *common], cwd=ROOT, capture_output=True, text=True)
    assert "4 already done, 0 to run" in r.stdout
    assert not any(os.path.exists(work / j / "run" / "adapter") for j in os.listdir(work))
