"""recipes.py: what a training run is configured with. The named recipes are data, each value with its source.

A recipe is a dict from train.py's options to values, each value with the place it comes from (the
official QeRL script that set it, the paper, a library's default, or "ours" with the reason). train.py
reads nothing else: no value hides in code, and `--help`, the README's table (`python recipes.py`) and
the run's first lines are all printed from these dicts.

    recipe      what it is
    gsm8k       the paper's 7B run: Qwen2.5-7B-Instruct in NVFP4 + LoRA + AQN, DAPO on GSM8K, one GPU
    gsm8k-bf16  the 16-bit LoRA baseline of the same run: a bf16 base, its learning rate, no noise
    official    gsm8k with the official script's batch and length: 1 prompt x 2 completions a step, one
                epoch (7,473 steps), no dynamic sampling
    bigmath     the paper's BigMath run (the official bf16 scripts' data): 1,024-token prompts, 4,096 new
    tiny        the bundled demo: a 0.9M-parameter policy on the synthetic arith task, CPU, minutes

"script" below is NVlabs/QeRL training/dapo_qwen2.5-7b_nvfp4_single_gpu.sh, the same at the first release
(1bf4803, the paper's time) and at HEAD (e8c6e79), with qerl.py, src/open_r1/configs.py and its TRL fork
(trl_trainer/). Where the script sets nothing, the value is TRL's or PEFT's default, and says so.

How a run's values are found, lowest first:
1. the recipe: `--recipe`, else tiny for the bundled tiny policy (or no --model), else gsm8k (gsm8k-bf16
   with `--quant bf16`), so that `python train.py --model qwen2.5-7b --algo dapo` is the paper's run;
2. the algorithm's (ALGOS): the loss that defines DAPO or GRPO (clip range, KL weight, aggregation),
   and for GRPO no dynamic sampling and no overlong shaping, which are DAPO's;
3. what the command line gives.
Then the values derived from others (`derive`): the held-out set from --data, the warm-up steps from
the recipe's warm-up ratio, the soft overlong band from its share of the budget, AQN on for an NVFP4
base only, the update's temperature from the rollout's, the prompt that the reward variant was trained
with.

What the 16-bit baseline is. The official scripts add AQN's noise only where the model's path names an
NVFP4 model (qerl.py: `noise_scheduler = 'nvfp4' in model_name`): the paper's LoRA baseline has no
noise. So here `--quant bf16` runs without it, and the bf16 + AQN ablation is an explicit `--aqn`.

Why 16 prompts x 8 completions and not the script's 1 x 2. The script's per-device batch of 2 with
num_generations 2 is one prompt and its two samples a step: 7,473 optimizer steps for an epoch of
GSM8K, AQN stages of 747 steps, an lr of 1e-5 per step. A group of 2 has an advantage only when one
sample is right and one wrong, and a step's gradient is one prompt's. The gsm8k recipe takes 16
prompts x 8 (DAPO uses 16 samples): 500 steps for about the same epoch (8,000 prompts), 15x fewer
optimizer steps of a 64x larger batch at the same lr, so less movement per sample seen and less
noise per step; AQN's stages are 50 steps. `--recipe official` runs the script's schedule as it is.

Departures from the official code that are not values: AQN's noise really reaches the rollout model (the
official hook is inert: tests/test_aqn.py), and the held-out evaluation applies the trained adapter and
norms (tests/test_eval.py). The official QeRL's known bugs, and the tests that keep them out: DESIGN.md.
"""
import argparse
import importlib.util
import json
import math
import os
import sys
from dataclasses import dataclass

import grpo
import hub
import lora
import tasks
from data import DATASETS


@dataclass(frozen=True)
class V:
    """A recipe's value and where it comes from."""
    value: object
    source: str


SCRIPT = "script"
GSM8K = {
    "model": V("qwen2.5-7b", "script: MODEL_PATH, an NVFP4 Qwen2.5-7B-Instruct"),
    "quant": V("nvfp4", "script: the NVFP4 model (4.5 bits a weight)"),
    "data": V("gsm8k", "script: DATA_NAME gsm8k (its 7,473 training problems)"),
    "eval_data": V(None, "the test split of --data"),
    "steps": V(500, "ours: 500 x 16 prompts is about the script's one epoch (module docstring)"),
    "prompts": V(16, "ours: the script's 1 prompt x 2 samples a step is the official recipe"),
    "group_size": V(8, "ours: DAPO samples 16, the script 2"),
    "max_new_tokens": V(2048, "script: max_completion_length for GSM8K"),
    "temperature": V(1.0, "TRL's default (the script sets none)"),
    "top_p": V(1.0, "TRL's default"),
    "update_passes": V(1, "script: num_iterations 1 (one pass, on-policy)"),
    "micro_batch": V(8, "ours: memory (the loss sums to the whole batch's)"),
    "lr": V(1e-5, "script (the bf16 scripts: 5e-6)"),
    "warmup_ratio": V(0.1, "script: warmup_ratio 0.1, linear"),
    "min_lr_ratio": V(0.0, "script: lr_scheduler_type cosine, to 0"),
    "weight_decay": V(0.1, "script: on LoRA; the HF Trainer exempts every norm weight"),
    "adam_beta2": V(0.99, "script: adam_beta1 0.9, adam_beta2 0.99"),
    "grad_clip": V(0.2, "script: max_grad_norm, over LoRA and the norms"),
    "lora_rank": V(16, "script: lora_rank"),
    "lora_alpha": V(16.0, "script: lora_alpha"),
    "lora_dropout": V(0.0, "PEFT's default (the script sets none)"),
    "lora_targets": V(",".join(lora.TARGETS), "src/open_r1/configs.py: lora_target_modules"),
    "train_norms": V(True, "script: --ln True, the blocks' two RMSNorms as PEFT modules_to_save"),
    "eps_low": V(0.2, "TRL's epsilon"),
    "adv_std": V("group", "TRL's scale_rewards: (r - mean) / (std + 1e-4); ours 1e-6"),
    "dynamic_sampling": V(True, "ours (DAPO's): TRL keeps all-equal groups, whose zero-advantage tokens "
                                "only grow the token mean's divisor"),
    "max_sampling_rounds": V(3, "ours: then it trains on what it found, and says so"),
    "overlong_share": V(0.0, "script: no length term in the reward; truncated samples are masked"),
    "mask_truncated": V(True, "script: mask_truncated_completions"),
    "ratio": V("trainer", "script: TRL with num_iterations 1 takes the trainer's own detached logprobs"),
    "reward": V("paper", "1bf4803's GSM8K reward, the code of the paper's time (tasks.py: the variants)"),
    "aqn_stages": V(10, "script: num_stages; stage 0 noise-free; steps counted from 0 here, from 1 by the "
                        "official trainer, so each boundary comes one step later here (aqn.py)"),
    "sigma_start": V(1e-2, "script: sigma_start; on the two norms of every block, fresh each rollout and taken out "
                           "after (the official hook would add to every RMSNorm, the final one too: aqn.py)"),
    "sigma_end": V(1e-4, "script: sigma_end (the paper's text says 5e-4)"),
    "eval_every": V(50, "ours"),
    "eval_limit": V(500, "ours: the first 500 of GSM8K's 1,319 test problems"),
    "eval_temperature": V(0.6, "eval/gsm8k.py: SamplingParams(temperature=0.6, top_p=0.95, max_tokens=1024)"),
    "eval_top_p": V(0.95, "eval/gsm8k.py"),
    "eval_max_new_tokens": V(1024, "eval/gsm8k.py"),
    "device": V(None, "ours: the GPU when there is one"),
}

GSM8K_BF16 = {
    **GSM8K,
    "model": V("qwen2.5-7b", "training/dapo_qwen2.5-7b_bf16_single_gpu.sh: Qwen/Qwen2.5-7B-Instruct"),
    "quant": V("bf16", "the bf16 scripts: the 16-bit LoRA baseline"),
    "lr": V(5e-6, "the bf16 scripts"),
    "data": V("gsm8k", "ours: the bf16 scripts train on BigMath; GSM8K here, so only the base differs"),
}

OFFICIAL = {
    **GSM8K,
    "prompts": V(1, "script: per_device_train_batch_size 2 = num_generations: one prompt a step"),
    "group_size": V(2, "script: num_generations 2"),
    "steps": V(7473, "script: num_train_epochs 1 over GSM8K's 7,473 problems"),
    "micro_batch": V(2, "script: the step's two sequences at once"),
    "dynamic_sampling": V(False, "TRL: every group is kept"),
    "eval_every": V(500, "ours"),
}

BIGMATH = {
    **GSM8K,
    "data": V("bigmath", "the bf16 scripts: DATA_NAME bigmath (open-r1/Big-Math-RL-Verified-Processed)"),
    "eval_data": V("math500", "ours: BigMath has no test split; MATH500 is among the paper's benchmarks"),
    "max_new_tokens": V(4096, "script: max_completion_length for bigmath"),
    "reward": V("official", "qerl.py's BigMath reward: math-verify + the 0.2 format reward (tasks.py)"),
    "eval_max_new_tokens": V(4096, "ours: the training budget"),
    "eval_temperature": V(0.6, "ours: as the GSM8K eval"),
}

TINY = {
    **GSM8K,
    "model": V("tiny", "assets/tiny, trained by tiny.py"),
    "data": V("arith", "arith.py: a synthetic task the tiny policy half-solves"),
    "steps": V(30, "tuned: the README's curve, in a few CPU minutes"),
    "max_new_tokens": V(64, "arith's solutions fit in 49 tokens"),
    "micro_batch": V(128, "the whole batch at once: a tiny model"),
    "lr": V(2e-3, "tuned: a 0.9M-parameter model learns in 30 steps"),
    "warmup_ratio": V(0.05, "tuned: one warm-up step of the 30"),
    "min_lr_ratio": V(0.1, "tuned: a final lr of 0 would waste the last steps"),
    "lora_rank": V(32, "tuned: rank 16 learned half as much in the first 10 steps"),
    "lora_alpha": V(32.0, "tuned, with the rank"),
    "overlong_share": V(0.2, "DAPO's soft overlong band over the last fifth of the budget"),
    "reward": V("lenient", "arith's answers graded leniently, with no format part"),
    "eval_every": V(10, "ours"),
    "eval_limit": V(256, "ours"),
    "eval_temperature": V(1.0, "the rollout's: the tiny policy is measured as it samples"),
    "eval_top_p": V(1.0, "the rollout's"),
    "eval_max_new_tokens": V(64, "the training budget"),
    "device": V("cpu", "the README's run: fp32 on the CPU (a GPU would run bf16, another run)"),
}

RECIPES = {"gsm8k": GSM8K, "gsm8k-bf16": GSM8K_BF16, "official": OFFICIAL, "bigmath": BIGMATH, "tiny": TINY}

# What defines each algorithm's loss, over any recipe (grpo.py and dapo.py say why).
ALGOS = {
    "dapo": {"eps_high": V(0.28, "script: epsilon_high (DAPO's clip-higher)"),
             "beta": V(0.0, "script: beta 0 (DAPO: no KL term)"),
             "loss_agg": V("token-mean", "script: loss_type bnpo, the token mean over the batch")},
    "grpo": {"eps_high": V(0.2, "GRPO's symmetric clip"), "beta": V(0.04, "TRL's GRPO default"),
             "loss_agg": V("seq-mean-token-mean", "GRPO: each sequence's token mean, then the mean"),
             "dynamic_sampling": V(False, "DAPO's, not GRPO's"), "overlong_share": V(0.0, "DAPO's, not GRPO's")},
}


def train_sets():
    """The named sets with a train split (arith, the synthetic one, first)."""
    return sorted((n for n, (_, src) in DATASETS.items() if src is None or "train" in src.splits),
                  key=lambda n: n != "arith")


def test_sets():
    return [n for n, (_, src) in DATASETS.items() if src is None or "test" in src.splits]


# ---------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------

def build_parser():
    """train.py's options. Those a recipe sets default to None here and take the recipe's value (`--help`
    prints it, with its source); the others show their default."""
    p = argparse.ArgumentParser(description="RL (DAPO/GRPO) on an NVFP4 base with LoRA and AQN.",
                                formatter_class=_HelpFormatter)
    a = p.add_argument
    a("--recipe", default=None, choices=list(RECIPES), help="named settings (recipes.py; default: tiny for the "
      "bundled tiny policy, else gsm8k, or gsm8k-bf16 with --quant bf16)")
    a("--model", default=None, help="alias (tiny, qwen2.5-7b, ...), HF folder, NVFP4 folder or hub id")
    a("--quant", default=None, choices=["nvfp4", "bf16"], help="base weights: NVFP4 (QeRL) or 16-bit (the LoRA baseline)")
    a("--algo", default="dapo", choices=list(ALGOS), help="policy-gradient algorithm")
    a("--data", default=None, help=f"training set: {', '.join(train_sets())} or a .jsonl path")
    a("--eval-data", default=None, help=f"held-out set: {', '.join(test_sets())} (their test split) or a .jsonl "
      "path (default: the test split of a named --data; needed with a --data file)")
    a("--device", default=None, help="cuda or cpu (default: cuda when available)")
    a("--seed", type=int, default=0, help="seeds data order, sampling, AQN noise and LoRA init")
    # the loop
    a("--steps", type=int, default=None, help="RL steps")
    a("--prompts", type=int, default=None, help="prompts (groups) per step")
    a("--group-size", type=int, default=None, help="G, completions per prompt")
    a("--max-new-tokens", type=int, default=None, help="completion budget")
    a("--temperature", type=float, default=None, help="rollout temperature")
    a("--train-temperature", type=float, default=None, help="the temperature the update scores the sampled tokens "
      "at (default: --temperature, as TRL's GRPO trainer divides the logits by the sampling temperature; 1 with a "
      "hotter --temperature makes the temperature act on the sampler alone, as AQN's noise does)")
    a("--top-p", type=float, default=None, help="rollout nucleus sampling")
    a("--update-passes", type=int, default=None, help="passes over each step's batch (1 = on-policy)")
    a("--micro-batch", type=int, default=None, help="sequences per forward/backward at full length; completions "
      "that stop early pack more into the same memory")
    a("--logp-chunk", type=int, default=1024, help="completion tokens per lm_head chunk when computing logprobs")
    a("--checkpointing", default="auto", choices=["auto", "on", "off"],
      help="activation checkpointing in the update (auto: off on a GPU where a micro-batch fits without)")
    a("--mem-cap-gb", type=float, default=None, help="plan the step into this many GB of the GPU (default: all "
      "this process can allocate); the plan is printed at start (memory.py)")
    a("--no-compile", action="store_true", help="run the update's blocks eagerly (default: torch.compile on a GPU)")
    a("--fp8-update", action="store_true", help="NVFP4 base: the update's base GEMMs on FP8 tensor cores "
      "(engine/fp8.py); faster on Hopper, less exact (results/fp8_update.md)")
    a("--fp8-kv", action="store_true", help="the rollout's KV cache in FP8 (E4M3, a scale a token and kv head: "
      "rollout.KVCache): about half its memory, so more rows a rollout call for a large model (a decode step "
      "faster only at long completions); the sampler's logprobs move away from the trainer's (results/fp8_kv.md)")
    # the optimizer
    a("--lr", type=float, default=None, help="peak learning rate")
    a("--warmup-steps", type=int, default=None, help="linear warm-up steps (default: the recipe's warm-up ratio "
      "of --steps, at least 1)")
    a("--min-lr-ratio", type=float, default=None, help="the cosine decays to lr * this")
    a("--weight-decay", type=float, default=None, help="AdamW weight decay on the LoRA parameters (none on norms)")
    a("--adam-beta2", type=float, default=None, help="AdamW beta2 (beta1 0.9)")
    a("--grad-clip", type=float, default=None, help="max global grad norm")
    # LoRA
    a("--lora-rank", type=int, default=None, help="LoRA rank r")
    a("--lora-alpha", type=float, default=None, help="LoRA alpha, scaling alpha/r")
    a("--train-norms", action=argparse.BooleanOptionalAction, default=None, help="also train every block's two "
      "RMSNorm weights (PEFT's modules_to_save)")
    a("--lora-dropout", type=float, default=None, help="LoRA dropout")
    a("--lora-targets", default=None, help="comma-separated module names")
    # the loss
    a("--eps-low", type=float, default=None, help="lower clip range")
    a("--eps-high", type=float, default=None, help="upper clip range")
    a("--beta", type=float, default=None, help="k3 KL weight to the LoRA-disabled reference")
    a("--loss-agg", default=None, choices=sorted(grpo.AGG_MODES), help="loss aggregation")
    a("--adv-std", default=None, choices=["group", "batch", "none"], help="advantage normalization (none = Dr. GRPO)")
    a("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=None, help="DAPO: resample until the "
      "step holds --prompts groups whose rewards differ")
    a("--max-sampling-rounds", type=int, default=None, help="DAPO: rollout rounds per step to find them")
    a("--overlong-buffer", type=int, default=None, help="DAPO's soft overlong band, in tokens before the budget "
      "(0 = off; default: the recipe's share of --max-new-tokens)")
    a("--mask-truncated", action=argparse.BooleanOptionalAction, default=None, help="mask completions cut at "
      "--max-new-tokens out of the loss (they still count in their group's advantages)")
    a("--ratio", default=None, choices=list(grpo.RATIO_MODES), help="the PPO ratio's denominator: trainer = the "
      "update's own logprobs (1 in one pass), sampler = the rollout's, tis = trainer's ratio times "
      "min(pi_trainer/pi_sampler, --tis-cap)")
    a("--tis-cap", type=float, default=2.0, help="C of --ratio tis (FlashRL, verl and TRL use 2)")
    a("--reward", default=None, choices=list(tasks.REWARDS), help="the reward variant (tasks.py: paper = the "
      "1bf4803 reward and prompt, official = HEAD's, strict/lenient = ours)")
    a("--signed-reward", action="store_true", help="--reward strict|lenient: correctness +1/-1 instead of 1/0")
    a("--format-reward", type=float, default=None, help="--reward strict|lenient: the weight of the format part "
      "(default 0; paper and official pay their source's)")
    a("--prompt", default=None, choices=list(tasks.PROMPT_STYLES), help="how problems are asked (default: as the "
      "reward variant was trained: tasks.REWARDS)")
    # AQN
    a("--aqn", action=argparse.BooleanOptionalAction, default=None, help="Adaptive Quantization Noise on the "
      "rollout's norms (default: on for an NVFP4 base, off for bf16, as the official scripts)")
    a("--aqn-stages", type=int, default=None, help="noise stages over the run")
    a("--sigma-start", type=float, default=None, help="AQN sigma at stage 1")
    a("--sigma-end", type=float, default=None, help="AQN sigma at the last stage")
    a("--aqn-update", action="store_true", help="also apply the step's noise during the update pass")
    # evaluation, logging, checkpoints
    a("--eval-every", type=int, default=None, help="held-out evaluation every N steps (0 = start and end only)")
    a("--eval-limit", type=int, default=None, help="held-out items")
    a("--eval-samples", type=int, default=1, help="samples per held-out item (accuracy = mean over them)")
    a("--eval-temperature", type=float, default=None, help="held-out sampling temperature (0 = greedy)")
    a("--eval-top-p", type=float, default=None, help="held-out nucleus sampling")
    a("--eval-max-new-tokens", type=int, default=None, help="held-out completion budget")
    a("--log-samples", type=int, default=2, help="completions per step written to samples.jsonl")
    a("--plot-every", type=int, default=5, help="refresh curves.png every N steps")
    a("--save-every", type=int, default=10, help="checkpoint every N steps (0 = only at the end)")
    a("--out", default=None, help="output folder (default runs/<timestamp>-<run id>): new or empty; a folder "
      "holding an earlier run is refused (continue it with --resume, or replace it with --force)")
    a("--force", action="store_true", help=hub.FORCE_HELP)
    a("--resume", default=None, help="continue the run in this folder from its checkpoint, with its settings "
      "(args.json). Only " + ", ".join(f"--{k.replace('_', '-')}" for k in sorted(RESUMABLE - {"force"})) +
      " may change; a larger --steps extends a run, its extra steps at the schedules' end")
    a("--log", default=None, choices=["tensorboard", "wandb"], help="also send the metrics to TensorBoard "
      "(OUT/tensorboard) or Weights & Biases (offline unless WANDB_MODE=online); optional packages")
    return p


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None: a recipe fills those (with_recipe_help says which value)."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


# What --resume lets a user change: how long the run goes on, how often it logs, evaluates and saves,
# and how each step's work is laid out on the device (the same sums, so the same run).
RESUMABLE = {"steps", "eval_every", "save_every", "plot_every", "log_samples", "log", "micro_batch", "logp_chunk",
             "checkpointing", "no_compile", "device", "force", "mem_cap_gb"}
# Options renamed since a run's args.json was written: old name -> (new name, how the value maps).
RENAMED = {"no_aqn": ("aqn", lambda v: not v), "no_dynamic_sampling": ("dynamic_sampling", lambda v: not v)}


def parse(argv=None):
    """The run's settings: the command line over its recipe (a new run), or a resumed run's own (args.json)
    with what RESUMABLE lets the command line change; every value derived and checked. Exits with one
    message naming every bad value, before any model loads."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser()
    if "-h" in argv or "--help" in argv:
        with_recipe_help(parser, [a for a in argv if a not in ("-h", "--help")])
    args = parser.parse_args(argv)
    args = resume_args(argv, args.resume) if args.resume else fill(args)
    try:
        check(args)
    except SystemExit as e:
        if not args.resume:
            raise
        raise SystemExit(f"{e}\n  (the run's settings, read from {os.path.join(args.resume, 'args.json')})") from None
    return args


def choose(args):
    """The recipe a new run starts from (the module docstring's rule)."""
    if args.recipe:
        return args.recipe
    if args.model is None or is_tiny(args.model):
        return "tiny"
    return "gsm8k-bf16" if args.quant == "bf16" else "gsm8k"


def fill(args):
    """Every None option from the recipe, then the algorithm over it (ALGOS), then the derived values."""
    args.recipe = choose(args)
    values = {**{k: v.value for k, v in RECIPES[args.recipe].items()},
              **{k: v.value for k, v in ALGOS[args.algo].items()}}
    for k, v in values.items():
        if k in vars(args) and getattr(args, k) is None:
            setattr(args, k, v)
    args.warmup_ratio, args.overlong_share = values["warmup_ratio"], values["overlong_share"]
    return derive(args)


def derive(args):
    """The values that follow from others, where the command line left them unset."""
    if args.eval_data is None and args.data in test_sets():
        args.eval_data = args.data  # (a file, or a set without a test split: none; check asks for one)
    if args.eval_max_new_tokens is None:
        args.eval_max_new_tokens = args.max_new_tokens
    if args.warmup_steps is None and isinstance(args.steps, int):  # (HF rounds the ratio up: 1 step apart at most)
        args.warmup_steps = max(1, int(args.warmup_ratio * args.steps))
    if args.overlong_buffer is None and isinstance(args.max_new_tokens, int):
        args.overlong_buffer = int(args.overlong_share * args.max_new_tokens + 1e-9)
    if args.aqn is None:
        args.aqn = args.quant == "nvfp4"
    if args.train_temperature is None:  # (a run's args.json from before the option resumes so too)
        args.train_temperature = args.temperature
    return args  # (--prompt None: each problem asked as the reward variant asks its kind, prompt_style)


def prompt_style(args, kind):
    """How a problem of `kind` is asked: --prompt, else the prompt the reward variant was trained with."""
    return args.prompt or tasks.REWARDS[args.reward].prompt[kind]


def kv_cache(args):
    """What the rollout's KV cache stores (rollout.generate's kv_cache): "fp8" with --fp8-kv, else "model"."""
    return "fp8" if args.fp8_kv else "model"


def lora_targets(args):
    """--lora-targets as a tuple of linear names."""
    return tuple(t.strip() for t in args.lora_targets.split(",") if t.strip())


def is_tiny(model):
    """Whether --model names the bundled tiny policy: its alias in any case, or its folder by any path."""
    target = hub.ALIASES.get(model.lower(), model)
    return os.path.realpath(target) == os.path.realpath(hub.ALIASES["tiny"])


def with_recipe_help(parser, argv):
    """--help: each option a recipe sets says the value that the recipe chosen by the rest of the command line
    gives it, and where that value comes from."""
    known = fill(parser.parse_known_args(argv)[0])
    table = {**RECIPES[known.recipe], **ALGOS[known.algo]}
    for action in parser._actions:
        entry = table.get(action.dest)
        if entry is not None and action.default is None and action.help:
            action.help += f" [{known.recipe}, {known.algo}: {entry.value}; {entry.source}]".replace("%", "%%")
    parser.epilog = (f"Values in brackets: recipe {known.recipe} with --algo {known.algo}; another --recipe, --model, "
                     f"--quant or --algo before --help shows theirs. `python recipes.py` prints every recipe.")


def saved_args(run_dir):
    """The settings a run was started with (its args.json), for --resume; options added to train.py since then
    take their defaults (the run's recipe's, where it sets them), and renamed ones their new names."""
    path = os.path.join(run_dir, "args.json")
    if not os.path.exists(path):
        sys.exit(f"train.py: cannot resume {run_dir}: no args.json in it")
    try:
        stored = hub.read_json(path)
    except ValueError as e:
        sys.exit(f"train.py: cannot resume {run_dir}: {path} is damaged ({e})")
    for old, (new, convert) in RENAMED.items():
        if old in stored and new not in stored:
            stored[new] = convert(stored.pop(old))
    defaults = vars(build_parser().parse_args([]))
    return fill(argparse.Namespace(**{**defaults, **stored, "resume": run_dir}))


def resume_args(argv, run_dir):
    """--resume DIR: the run's own settings, with what RESUMABLE lets the command line change. Any other
    option given with a value that differs from the run's stops here, naming each."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    given = vars(p.parse_args(argv))
    args = saved_args(run_dir)
    if given.get("out") not in (None, run_dir) and os.path.realpath(given["out"]) != os.path.realpath(run_dir):
        sys.exit(f"train.py: --resume {run_dir} writes into {run_dir}; drop --out {given['out']} (or start a new "
                 f"run there without --resume)")
    clash = [k for k, v in given.items() if k not in RESUMABLE | {"resume", "out"} and v != getattr(args, k, None)]
    if clash:
        sys.exit(f"train.py: --resume {run_dir} keeps the run's settings (its args.json), and these differ from "
                 f"them: " + ", ".join(f"--{k.replace('_', '-')} {given[k]} (the run's: {getattr(args, k, None)})"
                                       for k in clash) +
                 ". Drop them to continue the run, or start a new run with --out to change them; only "
                 + ", ".join(f"--{k.replace('_', '-')}" for k in sorted(RESUMABLE - {"force"})) + " may change on resume")
    args.changed = {k: (getattr(args, k, None), v) for k, v in given.items()
                    if k in RESUMABLE and v != getattr(args, k, None)}
    for k, (_, v) in args.changed.items():
        setattr(args, k, v)
    return args


# ---------------------------------------------------------------------------------------------
# Checks: every bad value, before any model loads
# ---------------------------------------------------------------------------------------------

def _finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


AT_LEAST = {"steps": 1, "prompts": 1, "group_size": 2, "max_new_tokens": 1, "micro_batch": 1, "logp_chunk": 1,
            "update_passes": 1, "max_sampling_rounds": 1, "aqn_stages": 2, "eval_limit": 1, "eval_samples": 1,
            "eval_max_new_tokens": 1, "lora_rank": 1, "plot_every": 1, "warmup_steps": 0, "eval_every": 0,
            "save_every": 0, "log_samples": 0, "seed": 0}
WHY = {"group_size": " (group-relative advantages need G >= 2)", "lora_rank": " (the adapters' rank r)",
       "aqn_stages": " (stage 0 is noise-free)", "seed": " (numpy's seeds are unsigned)"}
POSITIVE = {"lr": "the peak learning rate", "lora_alpha": "LoRA's alpha", "grad_clip": "the gradient-norm clip",
            "tis_cap": "the cap C of --ratio tis", "temperature": "the rollout temperature (the logprobs divide by it)",
            "train_temperature": "the update's temperature"}
IN_RANGE = {"top_p": (0, 1, "(0, 1]"), "eval_top_p": (0, 1, "(0, 1]"), "min_lr_ratio": (0, 1, "[0, 1]"),
            "lora_dropout": (0, 0.999999, "[0, 1)"), "adam_beta2": (0, 0.999999, "[0, 1)")}
NON_NEGATIVE = ("weight_decay", "eps_low", "eps_high", "beta", "sigma_start", "sigma_end", "eval_temperature")


def check(args):
    """Every bad value fails here, in one message that names each and says what is allowed, before any model
    is loaded or any folder written. (Each check is written so that NaN fails it.)"""
    problems = []
    flag = lambda k: f"--{k.replace('_', '-')} {getattr(args, k)}"
    for k, low in AT_LEAST.items():
        v = getattr(args, k)
        if not isinstance(v, int) or isinstance(v, bool) or v < low:
            problems.append(f"{flag(k)}: must be an integer >= {low}{WHY.get(k, '')}")
    for k, what in POSITIVE.items():
        if not (_finite(getattr(args, k)) and getattr(args, k) > 0):
            problems.append(f"{flag(k)}: {what} must be a finite number > 0")
    for k, (lo, hi, shown) in IN_RANGE.items():
        v = getattr(args, k)
        if not (_finite(v) and lo <= v <= hi and (v > 0 or shown[0] == "[")):
            problems.append(f"{flag(k)}: must be in {shown}")
    for k in NON_NEGATIVE:
        if not (_finite(getattr(args, k)) and getattr(args, k) >= 0):
            problems.append(f"{flag(k)}: must be a finite number >= 0")
    if args.mem_cap_gb is not None and not (_finite(args.mem_cap_gb) and args.mem_cap_gb > 0):
        problems.append(f"--mem-cap-gb {args.mem_cap_gb}: a number of GB > 0")
    if isinstance(args.overlong_buffer, int) and isinstance(args.max_new_tokens, int) and \
            not 0 <= args.overlong_buffer <= args.max_new_tokens:
        problems.append(f"--overlong-buffer {args.overlong_buffer} must be within [0, --max-new-tokens]")
    targets = lora_targets(args)
    unknown = [t for t in targets if t not in lora.TARGETS]
    if not targets or unknown:
        problems.append(f"--lora-targets {args.lora_targets}: {', '.join(unknown) or 'nothing'} matches no linear of "
                        f"the model; choose among {','.join(lora.TARGETS)}")
    problems += data_problems(args.data, args.eval_data)
    try:
        tasks.check_reward(args.reward, signed=args.signed_reward, format_weight=args.format_reward, prompt=args.prompt)
    except ValueError as e:
        problems.append(f"--reward {args.reward}: {e}")
    if args.fp8_update and args.quant != "nvfp4":
        problems.append("--fp8-update runs an NVFP4 base's GEMMs in FP8; with --quant bf16 drop it")
    if args.log:
        package = "tensorboard" if args.log == "tensorboard" else "wandb"
        if package not in sys.modules and importlib.util.find_spec(package) is None:
            problems.append(f"--log {args.log} needs the optional package {package}: pip install {package} (or drop --log)")
    if problems:
        sys.exit("train.py: " + "\n  ".join(["cannot start:"] + problems))


def data_problems(data, eval_data):
    """What is wrong with --data / --eval-data: a named set without the split it is used for, a file without
    a held-out set beside it (its items are what the run trains on), a file that is not there."""
    problems, named = [], lambda name: name in DATASETS  # (anything else is read as a file)
    if named(data) and data not in train_sets():
        only = ", ".join(sorted(DATASETS[data][1].splits))
        problems.append(f"--data {data} has no train split (only {only}); train on {', '.join(train_sets())} or a "
                        f".jsonl file, and evaluate on it with --eval-data {data}")
    choices = f"pass --eval-data FILE or a named test set ({', '.join(test_sets())})"
    if eval_data is None and named(data):
        problems.append(f"--data {data} has no test split to evaluate on: {choices}")
    elif eval_data is None:
        problems.append(f"--data {data} is read as a file, whose items are what the run trains on: {choices} "
                        f"for the held-out evaluation")
    elif named(eval_data) and eval_data not in test_sets():
        problems.append(f"--eval-data {eval_data} has no test split; pass a .jsonl file or one of "
                        f"{', '.join(test_sets())}")
    elif not named(data) and os.path.realpath(data) == os.path.realpath(eval_data):
        problems.append(f"--eval-data {eval_data} is the --data file: the held-out accuracy would grade trained "
                        f"items; pass another file or a named test set")
    for name in dict.fromkeys(n for n in (data, eval_data) if n is not None and not named(n)):
        if not os.path.isfile(name):
            problems.append(f"no data file at {name} (nor a named set: {', '.join(DATASETS)})")
    return problems


# ---------------------------------------------------------------------------------------------
# The README's table
# ---------------------------------------------------------------------------------------------

def markdown():
    """Every recipe as one markdown table: the gsm8k value and its source, then where each other recipe
    differs (blank where it takes gsm8k's), then the algorithms' values."""
    others = [n for n in RECIPES if n != "gsm8k"]
    rows = ["| option | gsm8k | source | " + " | ".join(others) + " |", "|---" * (3 + len(others)) + "|"]
    for k, v in GSM8K.items():
        diff = [str(RECIPES[n][k].value) if RECIPES[n][k].value != v.value else "" for n in others]
        rows.append(f"| {k} | {v.value} | {v.source} | " + " | ".join(diff) + " |")
    rows += ["", "| option | " + " | ".join(ALGOS) + " |", "|---" * (1 + len(ALGOS)) + "|"]
    for k in dict.fromkeys(k for algo in ALGOS.values() for k in algo):
        rows.append(f"| {k} | " + " | ".join(f"{a[k].value} ({a[k].source})" if k in a else "the recipe's"
                                               for a in ALGOS.values()) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in RECIPES:  # `python recipes.py gsm8k`: one recipe, as JSON
        print(json.dumps({k: {"value": v.value, "source": v.source} for k, v in RECIPES[sys.argv[1]].items()}, indent=1))
    else:
        print(markdown())
