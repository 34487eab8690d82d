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
    """bf16, NVFP4, and NVFP4 with the update on FP8 tensor cores, whose sampler-trainer mismatch is the
    largest (the sampler decodes the exact NVFP4 weights; the update rounds them and x to E4M3)."""
    a = bench_step.parse_args("--prompts 2 --group-size 3 --prompt-len 5 --new-tokens 6 --steps 1 --lora-rank 4 "
                              "--micro-batch 4 --decode-batch1".split())
    res = {}
    fp8 = fp4_gemm.fp8_supported(torch.device("cpu"))  # (torch 2.11's CPU _scaled_mm: one scale a tensor only)
    for mode in bench_step.MODES if fp8 else ("bf16", "nvfp4"):
        r = res[mode] = bench_step.run_mode(a, mode, torch.device("cpu"), tiny_shape())
        assert r["mode"] == mode and r["rollout_tok_s"] > 0 and r["update_tok_s"] > 0 and r["batch1_tok_s"] > 0
        assert r["mean_len"] == 6 and r["grad_norm"] > 0  # forced length; the update really had a gradient
    assert not fp8 or res["nvfp4+fp8"]["mismatch_kl"] > 10 * res["nvfp4"]["mismatch_kl"]
    with pytest.raises(SystemExit):  # (argparse's error names the allowed ones)
        bench_step.parse_args(["--modes", "nvfp4,fp8"])


def test_profile_says_where_the_step_went():
    """--profile: the rollout's decode in segments whose steps add up to the rollout's, and one more update
    profiled, its operators grouped by kind (the CPU's, here), the GEMMs among them."""
    a = bench_step.parse_args("--prompts 4 --group-size 4 --prompt-len 5 --new-tokens 40 --steps 1 --lora-rank 4 "
                              "--micro-batch 4 --early-stop 8 --profile".split())
    r = bench_step.run_mode(a, "nvfp4", torch.device("cpu"), tiny_shape())
    text = r["profile"]
    assert "rows:" in text and "GEMM" in text and "update (one more, profiled)" in text
    stats = dict(prefill_s=0.01, capture_s=0.5, decode_s=1.0, steps=31, segments=[(16, 20, 0.6), (4, 10, 0.4)])
    text = bench_step.profile_text("x", stats, (2.0, {"GEMM (cuBLAS, FP8 or bf16)": 1.2, "attention": 0.3}))
    assert "  16 rows:    20 steps,   0.60 s,  30.00 ms a step" in text and "0.50 s not" in text and "80.0%" in text


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
    assert (r["compiles"] == 0) == marks and r["grad_norm"] > 0


def test_steps_below_one_are_refused(capsys):
    """--steps counts the timed steps after the warm-up one: with none there is nothing to average, so the
    command line refuses it (argparse's error) before any model is built."""
    with pytest.raises(SystemExit):
        bench_step.parse_args(["--steps", "0"])
    assert "--steps 0: at least 1 timed step" in capsys.readouterr().err
    assert bench_step.parse_args(["--steps", "1"]).steps == 1
