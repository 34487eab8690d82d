"""engine/bench_step.py's RL step on the CPU with a tiny Qwen2 shape: the same code path the GPU table uses
(rollout with forced length, reward stand-in, train.update) runs and trains."""
import pytest
import torch

import fp4_gemm
import model as M
from engine import bench_step


def tiny_shape():
    return M.Config({**M.qwen25_config("0.5b").raw, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96})


def test_rl_step_runs_and_moves_lora_on_every_base():
    """bf16, NVFP4, NVFP4 with the update on FP8 tensor cores, whose sampler-trainer mismatch is the largest
    (the sampler decodes the exact NVFP4 weights; the update rounds them and x to E4M3), and NVFP4 with the
    rollout's KV cache in FP8, whose mismatch grows too."""
    a = bench_step.parse_args("--prompts 2 --group-size 3 --prompt-len 5 --new-tokens 6 --steps 1 --lora-rank 4 "
                              "--micro-batch 4 --decode-batch1".split())
    res = {}
    fp8 = fp4_gemm.fp8_supported(torch.device("cpu"))  # (torch 2.11's CPU _scaled_mm: one scale a tensor only)
    for mode in bench_step.MODES[:3] if fp8 else ("bf16", "nvfp4"):
        r = res[mode] = bench_step.run_mode(a, mode, torch.device("cpu"), tiny_shape())
        assert r["mode"] == mode and r["rollout_tok_s"] > 0 and r["update_tok_s"] > 0 and r["batch1_tok_s"] > 0
        assert r["mean_len"] == 6 and r["grad_norm"] > 0  # forced length; the update really had a gradient
    assert not fp8 or res["nvfp4+fp8"]["mismatch_kl"] > 10 * res["nvfp4"]["mismatch_kl"]
    r = bench_step.run_mode(a, "nvfp4+fp8kv", torch.device("cpu"), tiny_shape())  # the rollout's cache in FP8
    assert r["plan"]["rollout_rows"] == 6 and r["mean_len"] == 6 and r["grad_norm"] > 0
    assert r["mismatch_kl"] > 10 * res["nvfp4"]["mismatch_kl"]  # (the trainer recomputes K/V in 16 bits)
    with pytest.raises(SystemExit):  # (argparse's error names the allowed ones)
        bench_step.parse_args(["--modes", "nvfp4,fp8"])


def test_profile_says_where_the_step_went(monkeypatch):
    """--profile: one more step after the timed ones, its rollout's decode in segments whose steps add up to
    the rollout's, its update profiled (right after its rollout, as a timed step's: the same batch updated
    again would not meet what an update after a rollout meets), its operators grouped by kind (the CPU's,
    here), the GEMMs among them."""
    a = bench_step.parse_args("--prompts 4 --group-size 4 --prompt-len 5 --new-tokens 40 --steps 1 --lora-rank 4 "
                              "--micro-batch 4 --early-stop 8 --profile".split())
    order, generate, update, profile = [], bench_step.rollout.generate, bench_step.train.update, bench_step.profile_update
    monkeypatch.setattr(bench_step.rollout, "generate", lambda *x, **k: order.append("rollout") or generate(*x, **k))
    monkeypatch.setattr(bench_step.train, "update", lambda *x, **k: order.append("update") or update(*x, **k))
    monkeypatch.setattr(bench_step, "profile_update", lambda *x: order.append("profiled:") or profile(*x))
    r = bench_step.run_mode(a, "nvfp4", torch.device("cpu"), tiny_shape())
    assert order == ["rollout", "update"] * 2 + ["rollout", "profiled:", "update"]  # (warm-up, timed, profiled)
    text = r["profile"]
    assert "rows:" in text and "GEMM" in text and f"update: {r['update_s']:.2f} s a timed step" in text
    stats = dict(prefill_s=0.01, capture_s=0.5, decode_s=1.0, steps=31, segments=[(16, 20, 0.6), (4, 10, 0.4)])
    kinds = {"GEMM (cuBLAS, FP8 or bf16)": 1.2, "attention": 0.3}
    text = bench_step.profile_text("x", stats, (2.0, kinds, 0.25, {"attention": 0.05, "GEMM (cuBLAS, FP8 or bf16)": 0.2},
                                                [(0.15, "GEMM (cuBLAS, FP8 or bf16)", 0.01), (0.05, "attention", 0.9)]))
    assert "  16 rows:    20 steps,   0.60 s,  30.00 ms a step" in text and "80.0%" in text
    assert "update: 2.00 s a timed step; one more step's, under the profiler: 1.50 s in kernels, the GPU idle 0.25 s" in text
    assert "the idle, by the kernel it ended with: GEMM (cuBLAS, FP8 or bf16) 0.200 s, attention 0.050 s" in text
    assert "the longest: 0.150 s at 0.01 s (then GEMM (cuBLAS, FP8 or bf16)), 0.050 s at 0.90 s (then attention)" in text


def test_gaps_between_kernels_on_any_stream():
    """The GPU's idle stretches: overlapping kernels (two streams) cover time once, and each stretch is named
    by the kernel that ended it."""
    kernels = [(100, 110, "a"), (105, 120, "b"), (130, 140, "d"), (125, 128, "c")]
    assert bench_step.gaps_between(kernels) == [(pytest.approx(5e-6), "c", pytest.approx(20e-6)),
                                                (pytest.approx(2e-6), "d", pytest.approx(28e-6))]
    assert bench_step.gaps_between([]) == []


def test_rl_step_with_completions_that_stop_early():
    """--early-stop: the completions stop at different lengths (a stop list of vocab/MEAN random ids), and
    the update trains on what they sampled."""
    a = bench_step.parse_args("--prompts 4 --group-size 4 --prompt-len 5 --new-tokens 40 --steps 1 --lora-rank 4 "
                              "--micro-batch 4 --early-stop 8".split())
    assert len(bench_step.stop_ids(a, 96)) == 12 and bench_step.stop_ids(bench_step.parse_args([]), 96) == ()
    with pytest.raises(SystemExit):  # a mean length below one token means nothing
        bench_step.parse_args(["--early-stop", "0.5"])
    r = bench_step.run_mode(a, "nvfp4", torch.device("cpu"), tiny_shape())
    assert 1 < r["mean_len"] < 40 and r["grad_norm"] > 0 and r["capture_s"] == 0  # (no graphs on the CPU)
    assert r["mismatch_kl"] != r["mismatch_kl"]  # (not measured at the paired temperature: NaN, printed '-')


def test_early_stopping_bases_decode_the_same_lengths(monkeypatch):
    """--early-stop: the bases' models differ in every weight, yet every completion has the same length in
    each (so their times compare the same work): at PAIRED_TEMPERATURE the seeded noise picks the tokens. At
    temperature 1 the lengths differ, which is what the pairing is for."""
    a = bench_step.parse_args("--prompts 4 --group-size 4 --prompt-len 5 --new-tokens 40 --lora-rank 4 "
                              "--early-stop 8".split())
    prompts = torch.randint(0, 96, (a.prompts, a.prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    plan = bench_step.step_plan(a, tiny_shape(), "bf16", None)
    stops = bench_step.stop_ids(a, 96)

    def lengths(mode):
        model = bench_step.random_model(tiny_shape(), "bf16" if mode == "bf16" else "nvfp4", "cpu", seed=len(mode))
        with torch.no_grad():
            calls = bench_step.rollout_groups(model, prompts, a, plan, stops, step=0)
        return torch.cat([ro.lengths for _, ro in calls])

    paired = lengths("bf16")
    assert paired.unique().numel() > 3 and torch.equal(paired, lengths("nvfp4"))
    monkeypatch.setattr(bench_step, "PAIRED_TEMPERATURE", 1.0)
    assert not torch.equal(lengths("bf16"), lengths("nvfp4"))


@pytest.mark.parametrize("marks", [True, False])
def test_timed_steps_compile_nothing_new(monkeypatch, marks):
    """The update's blocks compiled (dynamo on its eager backend here; inductor on a GPU) meet micro-batches
    of new shapes in every step where completions stop early. Every block's input being marked dynamic
    (model.Transformer.hidden), the timed steps compile nothing after the warm-up step; without the marks
    (`marks` False) the first timed step compiles again, and run_mode's count says so. One micro-batch a
    step, so that the warm-up step sees a single shape."""
    import train

    monkeypatch.setattr(train, "compile_backend", lambda device, no_compile: "eager")
    if not marks:
        monkeypatch.setattr(torch._dynamo, "maybe_mark_dynamic", lambda t, d: None)
    a = bench_step.parse_args("--prompts 4 --group-size 4 --prompt-len 5 --new-tokens 40 --steps 2 --lora-rank 4 "
                              "--micro-batch 16 --early-stop 8".split())
    torch._dynamo.reset()
    try:
        r = bench_step.run_mode(a, "bf16", torch.device("cpu"), tiny_shape())
    finally:
        torch._dynamo.reset()  # leave no compiled Block.forward to the tests that count graphs
    assert (r["recompiles"] == 0) == marks and r["grad_norm"] > 0


def test_kernels_compiled_are_counted_through_tritons_hook(monkeypatch):
    """compiled_kernels counts the calls of Triton's post-compile hook (one a kernel variant compiled, or loaded
    from the disk cache, in this process: what a timed step must not do) from its first call on, and passes
    each to a hook set before it."""
    import triton

    seen = []
    monkeypatch.setattr(triton.knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(kw["key"]))
    monkeypatch.setattr(bench_step, "_kernels", {"compiled": 0, "hooked": False})
    assert bench_step.compiled_kernels() == 0
    for key in ("a", "b"):
        triton.knobs.runtime.jit_post_compile_hook(key=key)
    assert bench_step.compiled_kernels() == 2 and seen == ["a", "b"]


def test_steps_below_one_are_refused(capsys):
    """--steps counts the timed steps after the warm-up one: with none there is nothing to average, so the
    command line refuses it (argparse's error) before any model is built."""
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--steps", "0"])
    assert "--steps 0: at least 1 timed step" in capsys.readouterr().err
    assert bench_step.parse_args(["--steps", "1"]).steps == 1


def test_a_plan_of_several_rollout_calls_samples_the_same_and_releases_the_cache(monkeypatch):
    """A plan whose cache holds one group at a time (rollout_rows = G) and not beside the update: the rollout
    runs one call a prompt, each keyed as in one call of all (the same tokens as the plan that fits all rows
    at once), the cache is released before every update, and the update trains on the calls' groups."""
    import dataclasses

    from engine.bench_rollout import random_model

    cfg = tiny_shape()
    a = bench_step.parse_args("--prompts 3 --group-size 4 --prompt-len 5 --new-tokens 12 --early-stop 6 --steps 1 "
                              "--lora-rank 4 --micro-batch 4".split())
    whole = bench_step.step_plan(a, cfg, "nvfp4", None)
    split = dataclasses.replace(whole, rollout_rows=4, rollout_calls=3, keep_cache=False)
    model = random_model(cfg, "nvfp4", "cpu", pool_blocks=4096)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 96, (5,), generator=gen).tolist() for _ in range(3)]
    stops = bench_step.stop_ids(a, 96)
    c1 = [ro for _, ro in bench_step.rollout_groups(model, prompts, a, whole, stops, step=1)]
    c3 = bench_step.rollout_groups(model, prompts, a, split, stops, step=1)
    assert len(c1) == 1 and [lo for lo, _ in c3] == [0, 1, 2]
    c3 = [ro for _, ro in c3]
    G = a.group_size
    for i, ry in enumerate(c3):  # prompt i's rows: rows i*G.. of the one call, rows 0.. of its own call
        for j in range(G):
            n = int(ry.lengths[j])
            assert n == int(c1[0].lengths[i * G + j]) and torch.equal(c1[0].tokens[i * G + j, :n], ry.tokens[j, :n])
    assert len({int(n) for r in c3 for n in r.lengths}) > 2  # (rows of different lengths: stops drawn alike)
    released = []
    monkeypatch.setattr(bench_step.rollout, "release", lambda m: released.append(m))
    r = bench_step.run_mode(a, "nvfp4", torch.device("cpu"), cfg, plan=split)
    assert (r["rollout_calls"], r["rollout_rows"], r["keep_cache"]) == (3, 4, False) and r["grad_norm"] > 0
    assert len(released) == 1 + a.steps + 1  # before each step's update, and at the end


def test_a_plan_that_does_not_fit_builds_nothing():
    """The plan's problems are the result: no model is built, and the report says so beside the plan."""
    cfg = tiny_shape()
    a = bench_step.parse_args("--prompts 2 --group-size 2 --prompt-len 5 --new-tokens 6 --steps 1 --lora-rank 4".split())
    plan = bench_step.step_plan(a, cfg, "nvfp4", cap=1e5, headroom=0)
    assert not plan.fits
    r = bench_step.run_mode(a, "nvfp4", torch.device("cpu"), cfg, plan=plan)
    assert r["fits"] is False and "build_s" not in r
    text = bench_step.report(a, "header", {"nvfp4": r})
    assert "DOES NOT FIT" in text and "does not fit (the plan above says what to lower)" in text and "| base |" not in text


def test_the_report_and_its_recompile_line():
    """Each mode's lines: the first step beside the steady one, the peaks beside the plan's, the decode's
    share of its floor; graphs or kernels compiled in a timed step on a line of their own, loudly; the table's
    columns."""
    a = bench_step.parse_args("--decode-batch1".split())
    step = dict(rollout_s=3.0, update_s=2.0, other_s=0.1, step_s=5.1, rollout_tok_s=1e4, update_tok_s=4e4, mean_len=1024,
                capture_s=0.0, decode_s=2.5, decode_floor_s=1.5, decode_share=0.6, mismatch_kl=1e-3)
    r = dict(step, mode="nvfp4", fits=True, plan=dict(rollout_rows=32, rollout_calls=2, keep_cache=False, micro_batch=8,
                                                      logp_chunk=1024, peak_rollout_gb=70.0, peak_update_gb=72.0),
             plan_table="memory plan", build_s=2.0, built_gb=50.0, checkpointing="on", peak_gb=66.0,
             peak_rollout_gb=60.0, peak_update_gb=66.0, recompiles=0, kernel_recompiles=0, batch1_tok_s=50.0,
             batch1_ms_step=20.0, batch1_floor_ms=14.0, batch1_share=0.7,
             first_step=dict(step, step_s=60.0, capture_s=1.5, graphs_compiled=3, kernels_compiled=40))
    lines = "\n".join(bench_step.mode_lines(r))
    assert "first step 60.0 s" in lines and "3 graphs and 40 kernels compiled" in lines
    assert "steady 5.1 s (rollout 3.0 + update 2.0" in lines
    assert "(the plan: 65.2, 67.1)" in lines and "floor of 1.50 s (60%)" in lines and "floor 14.00 ms (70%)" in lines
    assert "recompiles in the timed steps: 0" in lines and "RECOMPILED" not in lines
    for graphs, kernels in ((2, 0), (0, 5)):
        again = "\n".join(bench_step.mode_lines(dict(r, recompiles=graphs, kernel_recompiles=kernels)))
        assert f"RECOMPILED: {graphs} graphs and {kernels} kernels compiled in the timed steps" in again
    table = bench_step.report(a, "header", {"nvfp4": r})
    assert "| first step s | decode share | recompiles (graphs / kernels) | mismatch_kl |" in table
    assert "| 60.0 | 60% | 0 / 0 | 1.00e-03 |" in table


def test_the_decode_floor_of_a_rollout():
    """decode_floor_s: a forward reads the weights and, for its live rows, the new tokens so far and the
    prompt of the fewest groups they fill (read once a group). Two segments by hand: 4 rows (2 groups of 2) for
    3 forwards, then 2 rows for 2."""
    weights, kv, bw = 1e9, 1000, 1.0  # 1 TB/s: a byte a picosecond
    by_hand = sum((weights + kv * (groups * 5 + rows * t)) / 1e12 for rows, groups, t in
                  ((4, 2, 1), (4, 2, 2), (4, 2, 3), (2, 1, 4), (2, 1, 5)))
    got = bench_step.decode_floor_s([(4, 3, 0.1), (2, 2, 0.1)], weights, kv, 2, 5, bw)
    assert abs(got - by_hand) < 1e-12 * by_hand


def test_the_sizes_and_the_cap():
    """--size 72b is Qwen2.5-72B-Instruct's config.json (the alias qwen2.5-72b names its repository); the
    command line refuses a size, a cap or a step it cannot run, before any model is built."""
    import hub

    c = M.qwen25_config("72b")
    assert (c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
            c.tie_word_embeddings, c.rope_theta, c.rms_norm_eps) == (8192, 29568, 80, 64, 8, 128, 152064, False, 1e6, 1e-6)
    assert hub.ALIASES["qwen2.5-72b"] == "Qwen/Qwen2.5-72B-Instruct"
    assert bench_step.parse_args(["--size", "72b", "--mem-cap-gb", "80"]).mem_cap_gb == 80
    for bad in (["--size", "110b"], ["--mem-cap-gb", "0"], ["--micro-batch", "0"], ["--group-size", "1"]):
        with pytest.raises(SystemExit):
            bench_step.parse_args(bad)


def test_running_out_of_memory_is_a_result(monkeypatch):
    """A mode that runs out of GPU memory (here the update, made to raise as torch does) is reported with its
    phase and torch's message beside the plan, and leaves the table to the modes that ran."""
    cfg = tiny_shape()
    a = bench_step.parse_args("--prompts 2 --group-size 2 --prompt-len 5 --new-tokens 4 --steps 1 --lora-rank 4".split())
    plan = bench_step.step_plan(a, cfg, "nvfp4", None)

    def update(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.00 GiB.")

    monkeypatch.setattr(bench_step.train, "update", update)
    with pytest.raises(torch.OutOfMemoryError) as e:
        bench_step.run_mode(a, "nvfp4", torch.device("cpu"), cfg, plan=plan)
    r = bench_step.out_of_memory("nvfp4", plan, e.value, cuda=False)
    (line,) = bench_step.mode_lines(r)
    assert "OUT OF MEMORY in the update" in line and "Tried to allocate 3.00 GiB" in line
    assert "| base |" not in bench_step.report(a, "header", {"nvfp4": r})
