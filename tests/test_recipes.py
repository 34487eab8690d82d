"""recipes.py: the named recipes as data (every value with its source, no algorithm value inside a recipe),
which recipe a command line picks, the values derived from others, the README's table and --help printed
from the data, resumed settings, and the checks that refuse bad values before any model loads."""
import json
import os
import re
import subprocess
import sys

import pytest

import hub
import recipes
import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_value_has_a_source_and_every_recipe_the_same_options():
    keys = set(recipes.GSM8K)
    for name, recipe in recipes.RECIPES.items():
        assert set(recipe) == keys, name
        for k, v in recipe.items():
            assert isinstance(v, recipes.V) and v.source.strip(), (name, k)
        assert not set(recipe) & {k for algo in recipes.ALGOS.values() for k in algo} - {"dynamic_sampling",
                                                                                            "overlong_share"}, name
        assert recipe["reward"].value in tasks.REWARDS, name
    parser_options = {a.dest for a in recipes.build_parser()._actions}
    # every recipe value is an option, but for the two ratios from which the derived options follow
    assert keys - parser_options == {"warmup_ratio", "overlong_share"}


def test_the_command_line_picks_the_recipe():
    pick = lambda *argv: recipes.parse(list(argv)).recipe
    assert pick() == "tiny" and pick("--model", "TINY") == "tiny" and pick("--model", hub.ALIASES["tiny"]) == "tiny"
    assert pick("--model", "qwen2.5-7b") == "gsm8k" and pick("--model", "qwen2.5-7b", "--algo", "grpo") == "gsm8k"
    assert pick("--model", "qwen2.5-7b", "--quant", "bf16") == "gsm8k-bf16"
    assert pick("--recipe", "official") == "official" and pick("--recipe", "bigmath") == "bigmath"
    args = recipes.parse(["--recipe", "official"])  # its model comes from the recipe
    assert (args.model, args.prompts, args.group_size, args.steps, args.dynamic_sampling) == ("qwen2.5-7b", 1, 2, 7473, False)
    assert args.warmup_steps == 747  # 10% of one epoch (HF rounds up: 748)


def test_the_algorithm_defines_its_loss_over_any_recipe():
    for recipe in recipes.RECIPES:
        dapo = recipes.parse(["--recipe", recipe])
        grpo = recipes.parse(["--recipe", recipe, "--algo", "grpo"])
        assert (dapo.eps_high, dapo.beta, dapo.loss_agg) == (0.28, 0.0, "token-mean"), recipe
        assert (grpo.eps_high, grpo.beta, grpo.loss_agg) == (0.2, 0.04, "seq-mean-token-mean"), recipe
        assert grpo.dynamic_sampling is False and grpo.overlong_buffer == 0, recipe  # (DAPO's, not GRPO's)
    assert recipes.parse([]).overlong_buffer == 12 and recipes.parse(["--max-new-tokens", "40"]).overlong_buffer == 8
    assert recipes.parse(["--algo", "grpo", "--eps-high", "0.3"]).eps_high == 0.3  # (the command line over both)


def test_a_16_bit_base_draws_no_noise_unless_asked():
    """The official scripts add AQN only to an NVFP4 model; --aqn is the bf16 + AQN ablation, opt-in."""
    assert recipes.parse([]).aqn is True and recipes.parse(["--quant", "bf16"]).aqn is False
    assert recipes.parse(["--quant", "bf16", "--aqn"]).aqn is True and recipes.parse(["--no-aqn"]).aqn is False
    assert recipes.parse(["--model", "qwen2.5-7b", "--quant", "bf16"]).aqn is False


def test_the_update_scores_at_the_rollouts_temperature_unless_told():
    """--train-temperature follows --temperature (TRL's GRPO trainer divides the logits by the sampling
    temperature), in every recipe; given, it is the update's alone and the rollout keeps --temperature."""
    for recipe in recipes.RECIPES:
        args = recipes.parse(["--recipe", recipe])
        assert args.train_temperature == args.temperature, recipe
    hot = recipes.parse(["--temperature", "1.5"])
    assert (hot.temperature, hot.train_temperature) == (1.5, 1.5)
    split = recipes.parse(["--temperature", "1.5", "--train-temperature", "1"])
    assert (split.temperature, split.train_temperature) == (1.5, 1.0)


def test_the_paper_recipe_evaluates_as_the_official_eval_and_rewards_as_the_paper():
    args = recipes.parse(["--model", "qwen2.5-7b", "--algo", "dapo"])
    assert (args.eval_temperature, args.eval_top_p, args.eval_max_new_tokens) == (0.6, 0.95, 1024)
    assert (args.reward, args.prompt, args.format_reward) == ("paper", None, None)
    assert recipes.prompt_style(args, "gsm8k") == "paper"  # (as the reward was trained: tasks.REWARDS)
    assert recipes.prompt_style(recipes.parse(["--prompt", "ours"]), "gsm8k") == "ours"
    assert (args.lr, args.max_new_tokens, args.warmup_steps, args.min_lr_ratio, args.lora_rank) == (1e-5, 2048, 50, 0.0, 16)


def test_the_readme_table_is_printed_from_the_data():
    out = subprocess.run([sys.executable, "recipes.py"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert lines[0] == "| option | gsm8k | source | gsm8k-bf16 | official | bigmath | tiny |"
    for k, v in recipes.GSM8K.items():
        row = next(line for line in lines if line.startswith(f"| {k} |"))
        assert str(v.value) in row and v.source in row, k
    assert "| lr | 1e-05 |" in out and "| 5e-06 |" in out and "| 0.002 |" in out
    one = json.loads(subprocess.run([sys.executable, "recipes.py", "tiny"], cwd=ROOT, capture_output=True, text=True,
                                    check=True).stdout)
    assert one["lr"] == {"value": 0.002, "source": recipes.TINY["lr"].source}
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        assert out.strip() in f.read(), "README.md's recipe table is stale: paste `python recipes.py` into it"


def test_help_prints_the_chosen_recipes_values(capsys):
    for argv, label, lr in (([], "[tiny, dapo: 0.002;", "0.002"), (["--quant", "bf16", "--model", "qwen2.5-7b"],
                                                                  "[gsm8k-bf16, dapo: 5e-06;", "5e-06")):
        with pytest.raises(SystemExit):
            recipes.parse(argv + ["--help"])
        raw = capsys.readouterr().out
        entry = " ".join(re.search(r"^  --lr .*?(?=^  -)", raw, re.S | re.M).group(0).split())
        assert label in entry and lr in entry, entry
        assert "default: None" not in raw


def test_resumed_settings_keep_the_run_and_map_renamed_options(tmp_path):
    saved = {k: v for k, v in vars(recipes.parse(["--steps", "7", "--no-aqn"])).items() if k != "no_compile"}
    (tmp_path / "args.json").write_text(json.dumps(saved))
    args = recipes.saved_args(str(tmp_path))
    assert args.no_compile is False and args.steps == 7 and args.aqn is False and args.resume == str(tmp_path)
    old = {k: v for k, v in saved.items() if k not in ("aqn", "dynamic_sampling")}
    (tmp_path / "args.json").write_text(json.dumps({**old, "no_aqn": True, "no_dynamic_sampling": True}))
    args = recipes.saved_args(str(tmp_path))  # (an args.json written before --aqn and --dynamic-sampling)
    assert args.aqn is False and args.dynamic_sampling is False and not hasattr(args, "no_aqn")
    # (an args.json written before --train-temperature: the update scores at the run's --temperature, as it did)
    hot = {k: v for k, v in vars(recipes.parse(["--temperature", "1.3"])).items() if k != "train_temperature"}
    (tmp_path / "args.json").write_text(json.dumps(hot))
    assert recipes.saved_args(str(tmp_path)).train_temperature == 1.3
    (tmp_path / "args.json").write_text(json.dumps({**hot, "train_temperature": 1.0}))
    args = recipes.saved_args(str(tmp_path))
    assert (args.temperature, args.train_temperature) == (1.3, 1.0)
    (tmp_path / "args.json").write_text("{")
    with pytest.raises(SystemExit, match="args.json is damaged"):
        recipes.saved_args(str(tmp_path))


@pytest.mark.parametrize("argv, message", [
    (["--seed", "-1"], "--seed -1: must be an integer >= 0"),
    (["--aqn-stages", "1"], "--aqn-stages 1: must be an integer >= 2 (stage 0 is noise-free)"),
    (["--temperature", "nan"], "--temperature nan: the rollout temperature (the logprobs divide by it) must be"),
    (["--train-temperature", "0"], "--train-temperature 0.0: the update's temperature must be a finite number > 0"),
    (["--train-temperature", "nan"], "--train-temperature nan: the update's temperature must be a finite number > 0"),
    (["--top-p", "0"], "--top-p 0.0: must be in (0, 1]"),
    (["--reward", "paper", "--format-reward", "0.1"], "--reward paper: the paper reward pays as its source does"),
    (["--prompt", "bare", "--reward", "strict", "--format-reward", "0.1"], "the bare prompt asks for no answer form"),
    (["--data", "{file}", "--eval-data", "{file}"], "is the --data file: the held-out accuracy would grade trained items"),
])
def test_bad_values_are_refused_together_before_anything_loads(argv, message, tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text('{"question": "1+1", "answer": "2"}\n')
    with pytest.raises(SystemExit) as e:
        recipes.parse([a.replace("{file}", str(f)) for a in argv])
    assert str(e.value).startswith("train.py: cannot start:") and message in str(e.value), str(e.value)
