"""Tests for logs.py: the start-up lines, a step's metrics and its console line, the JSONL record and
the curves."""
import json
import os

import torch

import ddp
import logs
import model as M
import recipes
import train


def tiny_model():
    cfg = M.Config({"model_type": "qwen2", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
                    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1})
    return M.Transformer.from_random(cfg, dtype=torch.float32)


def test_the_start_up_lines_say_the_base_its_kernels_and_whether_aqn_is_on(capsys):
    """The fp4 kernels are named only for an NVFP4 base; AQN is on for NVFP4 and off for bf16 unless --aqn
    asks for it; a changed recipe value is named."""
    m = tiny_model()
    for argv, fp4, aqn in ((["--quant", "nvfp4"], True, True), (["--quant", "bf16"], False, False),
                           (["--quant", "bf16", "--aqn", "--lr", "0.01"], False, True)):
        args = recipes.parse(argv)
        logs.header(args, m, 0, 1000, (10, 5), ddp.World(), torch.device("cpu"), "runs/x")
        out = capsys.readouterr().out
        assert ("fp4 matmuls" in out) is fp4, argv
        assert ("AQN on" in out) is aqn and ("AQN off" in out) is (not aqn), argv
        changed = out.split("changed: ")[1].split("\n")[0] if "changed: " in out else ""
        assert changed == {"nvfp4": "", "bf16": "quant"}[args.quant] + (", lr" if "--lr" in argv else ""), argv
        assert "10 train, 5 held-out" in out


def group(rewards, correct, lengths):
    t = lambda v: torch.tensor(v, dtype=torch.float32)
    return train.Group(item={}, reward=t(rewards), correct=t(correct), format=t([0.1] * len(rewards)),
                       overlong=t([0.0] * len(rewards)), lengths=t(lengths))


def test_a_steps_metrics_are_the_kept_groups_means():
    """The reward and its parts are means over every kept completion; the accuracy counts a completion right
    when its correctness reward is above 0; lengths give the mean and the longest."""
    groups = [group([1.1, 0.1], [1, 0], [4, 8]), group([0.1, 0.1], [0, 0], [2, 10])]
    m = logs.step_metrics(3, 1e-2, 1, 2, 1, groups, 1e-5)
    assert (m["step"], m["sigma"], m["aqn_stage"], m["rounds"], m["filtered_groups"], m["groups"]) == (3, 1e-2, 1, 2, 1, 2)
    assert abs(m["reward"] - 0.35) < 1e-6 and abs(m["reward_correct"] - 0.25) < 1e-6 and m["accuracy"] == 0.25
    assert abs(m["reward_format"] - 0.1) < 1e-6 and m["response_length"] == 6 and m["response_length_max"] == 10
    empty = logs.step_metrics(0, None, None, 3, 6, [], 1e-5)  # every group filtered: no means to take
    assert "reward" not in empty and empty["groups"] == 0


def test_the_console_line_puts_a_dash_where_a_metric_is_absent():
    m = {"step": 7, "reward": 0.5, "filtered_groups": 0, "sigma": 0.0, "time_rollout": 1.0, "time_update": 2.0,
         "rollout_tokens_per_s": 100.0, "peak_memory_gb": 1.5}
    text = logs.line(m)
    assert text.startswith("step    7 | reward 0.500 acc -") and "held-out" not in text
    assert "| held-out 0.250" in logs.line({**m, "heldout_accuracy": 0.25})


def test_the_record_appends_and_the_curves_are_replaced_whole(tmp_path):
    path = str(tmp_path / "metrics.jsonl")
    logs.append_jsonl(path, [{"step": 0}])
    logs.append_jsonl(path, [{"step": 1}, {"step": 2}])
    rows = [json.loads(s) for s in open(path)]
    assert [r["step"] for r in rows] == [0, 1, 2]
    png = str(tmp_path / "curves.png")
    rows = [{"step": i, "reward": 0.1 * i, "heldout_accuracy": 0.5 if i == 1 else None} for i in range(3)]
    logs.plot(rows, png, baseline=0.25)
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(tmp_path)) == ["curves.png", "metrics.jsonl"]  # (no temporary file left)
