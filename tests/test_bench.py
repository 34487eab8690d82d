"""bench.py's RL step on the CPU with a tiny Qwen2 shape: the same code path the GPU table uses
(rollout with forced length, reward stand-in, train.update) runs and trains."""
import pytest
import torch

import bench
import model as M


def test_rl_step_runs_and_moves_lora_on_both_bases():
    cfg = M.Config({**M.qwen25_config("0.5b").raw, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96})
    a = bench.parse_args("--prompts 2 --group-size 3 --prompt-len 5 --new-tokens 6 --steps 1 --lora-rank 4 "
                         "--micro-batch 4 --decode-batch1".split())
    for mode in ("bf16", "nvfp4"):
        r = bench.run_mode(a, mode, torch.device("cpu"), cfg)
        assert r["mode"] == mode and r["rollout_tok_s"] > 0 and r["update_tok_s"] > 0 and r["batch1_tok_s"] > 0
        assert r["step_s"] >= r["rollout_s"] and r["grad_norm"] > 0  # the update really had a gradient


def test_rl_step_with_completions_that_stop_early():
    """--early-stop: the completions stop at different lengths (a stop list of vocab/MEAN random ids), the
    rollout's batch shrinks as they do, and the update trains on what they sampled."""
    cfg = M.Config({**M.qwen25_config("0.5b").raw, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 96})
    a = bench.parse_args("--prompts 4 --group-size 4 --prompt-len 5 --new-tokens 40 --steps 1 --lora-rank 4 "
                         "--micro-batch 4 --early-stop 8".split())
    assert len(bench.stop_ids(a, 96)) == 12 and bench.stop_ids(bench.parse_args([]), 96) == ()
    with pytest.raises(SystemExit):  # a mean length below one token means nothing
        bench.parse_args(["--early-stop", "0.5"])
    r = bench.run_mode(a, "nvfp4", torch.device("cpu"), cfg)
    assert 1 < r["mean_len"] < 40 and r["grad_norm"] > 0 and r["capture_s"] == 0  # (no graphs on the CPU)
