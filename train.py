"""train.py: the QeRL loop — RL with GRPO or DAPO on an NVFP4 base model with LoRA and AQN.

One step (QeRL, arXiv 2510.11696, Sec. 3; the algorithms in grpo.py and dapo.py):

    prompts ─► rollout.generate (NVFP4 base + LoRA, AQN noise on the norms) ─► completions + logprobs
            ─► tasks.reward (+ DAPO's soft overlong penalty, where on) ─► rewards (num_groups, G)
            ─► dapo.collect_informative: resample until enough groups have mixed rewards (DAPO only)
            ─► grpo.group_advantages ─► one or more update passes in micro-batches:
               logp of the completion tokens (a micro-batch as one packed row, each prompt once
               for its samples; hidden states through lm_head in chunks, so the (B, T, vocab)
               float32 logits never exist at once), the clipped loss (its ratio against the trainer's
               own logprobs or the sampler's: --ratio), truncated completions masked out, backward
               through the frozen NVFP4 base into the LoRA parameters and the trained RMSNorm weights
               ─► grad-norm clip ─► AdamW ─► warm-up + cosine schedule

On a GPU the update runs each decoder block through torch.compile (model.compile_blocks; off with
--no-compile), which fuses the elementwise work between the GEMMs. The first update compiles them, one
graph for every micro-batch shape, as Transformer.hidden marks the token and sequence counts dynamic; the
rollout never runs compiled blocks. A micro-batch holds --micro-batch sequences where completions run to
the limit, and more in the same memory where they stop early (micro_batches). The update recomputes each
block's activations in backward (activation checkpointing) only where the largest micro-batch's would not
fit in the GPU's free memory (checkpointing_on). Each prompt runs once for its samples, with no padding
(model.shared_prompt_hidden). What each of these saves, measured: results/bench_h200.md.

`python train.py` with no arguments runs the bundled tiny policy (assets/tiny, trained by tiny.py)
on the synthetic arithmetic task, on the CPU (also where there is a GPU: the run and its numbers are
the README's there too; `--device cuda` moves it), in a few minutes. `python train.py --model qwen2.5-7b
--algo dapo` is the paper's recipe on one GPU. Defaults that depend on the model are filled by
`recipe()`; `--help` after --model/--algo/--quant prints the values that recipe takes.

The recipe, `--model qwen2.5-7b --algo dapo` (NVFP4), value by value. "Script" is the official
training/dapo_qwen2.5-7b_nvfp4_single_gpu.sh of NVlabs/QeRL (with qerl.py, utils/configs.py and its
TRL fork trl_trainer/); the 7B bf16 script differs in lr, data (BigMath) and AQN (off). The last column is where the
bundled tiny CPU demo (`python train.py`) differs, and why.

  hyperparameter        value                           source                                  tiny demo
  base model            Qwen2.5-7B-Instruct, NVFP4      script (MODEL_PATH: an NVFP4 model)     assets/tiny
  data                  GSM8K train                     script (DATA_NAME gsm8k)                arith
  steps x prompts x G   500 x 16 x 8 = 128 samples      ours: the script's 1 prompt x 2 samples  30 x 16 x 8
                        a step, ~1.07 epochs            (num_generations = per-device batch 2)
                                                        is a one-GPU demo; G = 8 (DAPO's is 16);
                                                        the script runs 1 epoch, as here
  completion budget     2048 tokens                     script (GSM8K: max_completion_length)   64
  prompt length         not cut                         script cuts at 256 (GSM8K's are shorter)
  sampling              temperature 1.0, top-p 1.0      TRL defaults (the script sets none)
  loss                  token mean over the batch,      script (loss_type bnpo, epsilon_high
                        clip 0.2 / 0.28, no KL          0.28, beta 0; TRL's epsilon 0.2)
  passes per batch      1                               script (num_iterations 1)
  PPO ratio             against the trainer's own       script: TRL with num_iterations 1 uses
                        logprobs: exactly 1 (--ratio)   the trainer's detached logp; sampler and
                                                        tis are the alternatives (grpo.py)
  dynamic sampling      on, up to 3 rounds              ours (DAPO's): TRL keeps all-equal
                                                        groups, whose zero-advantage tokens
                                                        only grow the token-mean's divisor
  advantages            (r - mean) / (std + 1e-6)       script: TRL's scale_rewards, + 1e-4
  reward                1 if right, graded strict (the  script: 2.0 strict + 0.2 for the format  lenient, no format
                        answer where asked) + 0.1 if    (halved: advantages divide by the
                        the answer is in that form      group's std); tasks.py says more
  prompt                our instruction (--prompt)      ours; --prompt official: the official
                                                        think/answer system prompt
  truncated samples     masked out of the loss          script (mask_truncated_completions)
  overlong penalty      off                             script (no length term in the reward)   soft, last 12 tokens
  optimizer             AdamW, float32 states           ours: the script's adamw_8bit saves
                                                        memory; LoRA's states are 0.3 GB at 7B
  lr                    1e-5 (bf16 base: 5e-6)          script (the bf16 script: 5e-6)          2e-3: 30 steps
  betas, eps            0.9, 0.99; 1e-8                 script (adam_beta1/2); torch default
  weight decay          0.1 on LoRA, 0 on the norms     script; the HF Trainer exempts every
                                                        parameter named like a norm
  warm-up               10% of the steps, linear        script (warmup_ratio 0.1)               5% (1 step)
  schedule              cosine to 0                     script (lr_scheduler_type cosine)       to 0.1 lr: 30 steps
  grad-norm clip        0.2 (LoRA and norms together)   script (max_grad_norm)
  LoRA                  r 16, alpha 16, dropout 0, on   script (lora_rank/alpha 16); configs.py  r 32, alpha 32: faster
                        q,k,v,o,gate,up,down, float32   targets; PEFT's dropout default         in its first 10 steps
  trained norms         both RMSNorms of every block    script (--ln True: qerl.py's
                        (float32, in the optimizer)     modules_to_save)
  AQN                   10 stages, stage 0 noise-free,  script (sigma_start/end, num_stages);
                        sigma 1e-2 -> 1e-4, on the two  noise_scheduler.py; the paper's text
                        norms of every block, rollout   says 5e-4; the scripts are the code
                        only                            released with it
  held-out eval         500 items every 50 steps,       ours                                    256, every 10, T 1.0
                        T 0.6, top-p 0.95
  micro-batch           8 sequences at full length      ours (memory; the sums are the batch's)  128
  update GEMMs          bf16 (the NVFP4 weight          script (vLLM samples, the trainer
                        dequantized a layer at a time)  dequantizes); --fp8-update: ours,
                                                        an option that changes the numbers

The tiny demo takes the recipe's values except where the last column says otherwise: it keeps the lr,
warm-up, floor, LoRA rank and soft overlong band it was tuned with (30 steps of a 0.9M-parameter model
from a weak start), its short completions and the lenient reward of its synthetic task.

Outputs, all under --out (default runs/<timestamp>-<the run id's first 6 hex digits>): metrics.jsonl (one
JSON line a step), samples.jsonl (a few completions a step), curves.png (refreshed as it runs),
summary.json (baseline_accuracy, final_accuracy, wall time), adapter/ (PEFT format), checkpoint/ (adapter,
optimizer, scheduler, step, data position and RNG as tensors and JSON, written atomically every
--save-every steps, the one before kept as checkpoint.old). `--resume DIR` continues from it exactly, with
the run's settings (args.json): it refuses other values of any option but those RESUMABLE lists, and a
larger --steps extends a run (the shorter run's summary.json is kept as summary.<its steps>-steps.json). A
new run refuses a folder that holds an earlier one, started there and perhaps still running
(hub.check_out's rules for every output folder; --force deletes it). `--log tensorboard|wandb` also streams
the metrics (optional packages).

Several GPUs (or CPU processes): `torchrun --nproc_per_node=N train.py ...` (several machines: ddp.py) runs N
ranks on one global batch of --prompts prompts. Each rank holds the model and samples, grades and trains on
its block of every round's prompts; every rank learns every group's rewards, so dynamic sampling fills the
global batch and the advantages are the global batch's; the loss is divided by the global batch's token or
sequence count and the gradients are summed over the ranks, which makes each step the one-process step over
the same batch, up to float rounding (ddp.py derives it; tests/test_ddp.py checks it). The rollout keys
depend on the prompt's global index, so the ranks sample what one process would. Rank 0 alone prints and
writes; the held-out evaluation is split over the ranks by its batches, with their seeds. A checkpoint
resumes on any number of ranks.

Departures from the official QeRL code beyond the table: AQN noise really reaches the rollout model
(tests/test_aqn.py); held-out evaluation applies the trained adapter and norms (tests/test_eval.py).
Every step logs the sampler-trainer mismatch on the sampled tokens (mismatch_kl, mismatch_ratio_max,
tis_clip_frac; grpo.py), whatever --ratio is.
"""
import argparse
import functools
import importlib.util
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import time
import uuid
import warnings

import numpy as np
import torch
from tqdm import tqdm

import adapters
import aqn
import dapo
import ddp
import fp4_gemm
import grpo
import lora
import rollout
import tasks
from data import DATASETS, load_dataset
from eval import default_batch, evaluate
from hub import resolve_device, stop_on_bad_input, stop_token_ids
from adapters import load_policy
from model import read_config
import hub


def _splits(source):
    return {"train", "test"} if source is None else set(source.splits)  # (None: arith, generated in both)


# data.py's named sets with a train split (arith, the synthetic one, first), and those with a test split.
TRAIN_SETS = sorted((n for n, (_, src) in DATASETS.items() if "train" in _splits(src)),
                    key=lambda n: n != "arith")
TEST_SETS = [n for n, (_, src) in DATASETS.items() if "test" in _splits(src)]


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None: those defaults depend on the model or --algo, and the
    option's help says how."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser():
    p = argparse.ArgumentParser(description="RL (DAPO/GRPO) on an NVFP4 base with LoRA and AQN.",
                                formatter_class=_HelpFormatter)
    # what to train
    p.add_argument("--model", default="tiny", help="alias (tiny, qwen2.5-7b, ...), HF folder, NVFP4 folder or hub id")
    p.add_argument("--quant", default="nvfp4", choices=["nvfp4", "bf16"], help="base weights: NVFP4 (QeRL) or 16-bit (the LoRA baseline)")
    p.add_argument("--algo", default="dapo", choices=["dapo", "grpo"], help="policy-gradient algorithm")
    p.add_argument("--data", default=None, help=f"training set: {', '.join(TRAIN_SETS)} (the named sets with a train "
                   f"split), or a .jsonl path (default: arith for tiny, gsm8k otherwise)")
    p.add_argument("--eval-data", default=None, help=f"held-out set: {', '.join(TEST_SETS)} (their test split) or a "
                   f".jsonl path (default: the test split of a named --data; needed with a --data file or a set "
                   f"without one)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cpu for tiny, else cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seeds data order, sampling, AQN noise and LoRA init")
    # the loop
    p.add_argument("--steps", type=int, default=None, help="RL steps (tiny: 30; paper recipe: 500, which at 16 prompts "
                   "a step is about one epoch of GSM8K's 7473, as the official scripts' one epoch)")
    p.add_argument("--prompts", type=int, default=None, help="prompts (groups) per step (16; the official scripts' 1 "
                   "prompt x 2 samples is a single-GPU demo)")
    p.add_argument("--group-size", type=int, default=8, help="G, completions per prompt (8; the official "
                   "scripts' 2 is a one-GPU demo)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="completion budget (tiny: 64; GSM8K recipe: 2048, "
                   "the official max_completion_length)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (official: TRL's default 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="rollout nucleus sampling")
    p.add_argument("--update-passes", type=int, default=1, help="passes over each step's batch (1 = on-policy)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward, at full length "
                   "(tiny: 128; 7B: 8); completions that stop early pack more into the same memory")
    p.add_argument("--logp-chunk", type=int, default=1024, help="completion tokens per lm_head chunk when computing logprobs")
    p.add_argument("--checkpointing", default="auto", choices=["auto", "on", "off"],
                   help="activation checkpointing in the update (auto: off on a GPU where a micro-batch fits without)")
    p.add_argument("--no-compile", action="store_true", help="run the update's blocks eagerly (default: torch.compile "
                   "on a GPU, which fuses their elementwise work)")
    p.add_argument("--fp8-update", action="store_true", help="NVFP4 base: run the update's base GEMMs on FP8 tensor "
                   "cores (the weight in E4M3, x and dY quantized row by row; engine/fp8.py). Faster on Hopper, less "
                   "exact: the sampler-trainer mismatch grows (results/fp8_update.md). Off by default")
    # optimizer (official scripts: AdamW beta2 0.99, weight decay 0.1, lr 1e-5 NVFP4 / 5e-6 bf16, 10% warm-up,
    # cosine to 0, grad clip 0.2; the table in the docstring gives each value's source)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (tiny: 2e-3; paper recipe: 1e-5 NVFP4, 5e-6 bf16)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (tiny: 5%% of --steps; paper "
                   "recipe: 10%%)")
    p.add_argument("--min-lr-ratio", type=float, default=None, help="the cosine decays to lr * this (tiny: 0.1; paper recipe: 0)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on the LoRA parameters (the "
                   "trained norms get none, as the HF Trainer exempts norm weights)")
    p.add_argument("--adam-beta2", type=float, default=0.99, help="AdamW beta2 (beta1 0.9)")
    p.add_argument("--grad-clip", type=float, default=0.2, help="max global grad norm")
    # LoRA (official: r 16, alpha 16 on q,k,v,o,gate,up,down, and the blocks' two RMSNorms trained)
    p.add_argument("--lora-rank", type=int, default=None, help="LoRA rank r (tiny: 32; paper recipe: 16)")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha, scaling alpha/r (tiny: 32; paper recipe: 16)")
    p.add_argument("--train-norms", action=argparse.BooleanOptionalAction, default=True, help="also train the "
                   "RMSNorm weights of every block (input_layernorm, post_attention_layernorm), saved as PEFT's "
                   "modules_to_save: the official --ln True")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="LoRA dropout")
    p.add_argument("--lora-targets", default=",".join(lora.TARGETS), help="comma-separated module names")
    # loss (DAPO: eps 0.2/0.28, token-mean, no KL; GRPO: eps 0.2, beta 0.04, sequence mean)
    p.add_argument("--eps-low", type=float, default=0.2, help="lower clip range")
    p.add_argument("--eps-high", type=float, default=None, help="upper clip range (dapo 0.28, grpo 0.2)")
    p.add_argument("--beta", type=float, default=None, help="k3 KL weight to the LoRA-disabled reference (grpo 0.04, dapo 0)")
    p.add_argument("--loss-agg", default=None, choices=sorted(grpo.AGG_MODES), help="loss aggregation (dapo token-mean, grpo seq-mean-token-mean)")
    p.add_argument("--adv-std", default="group", choices=["group", "batch", "none"], help="advantage normalization (none = Dr. GRPO)")
    p.add_argument("--no-dynamic-sampling", action="store_true", help="DAPO: keep groups whose rewards are all equal")
    p.add_argument("--max-sampling-rounds", type=int, default=3, help="DAPO: rollout rounds per step to find informative groups")
    p.add_argument("--overlong-buffer", type=int, default=None, help="DAPO soft overlong punishment band (tiny dapo: "
                   "max_new_tokens//5; paper recipe and grpo: 0 = off, the official reward has no length term)")
    p.add_argument("--mask-truncated", action=argparse.BooleanOptionalAction, default=True, help="mask completions "
                   "cut at --max-new-tokens out of the loss (they still count in their group's advantages): the "
                   "official mask_truncated_completions")
    p.add_argument("--ratio", default="trainer", choices=list(grpo.RATIO_MODES), help="what the PPO ratio is taken "
                   "against: trainer = the update's own logprobs (ratio 1 in one pass; the official code), sampler = the "
                   "rollout's (with its AQN noise), tis = trainer's ratio times min(pi_trainer/pi_sampler, --tis-cap)")
    p.add_argument("--tis-cap", type=float, default=2.0, help="C of --ratio tis (FlashRL, verl and TRL use 2)")
    p.add_argument("--signed-reward", action="store_true", help="correctness +1/-1 instead of 1/0")
    p.add_argument("--format-reward", type=float, default=None, help="weight of the format part of the reward "
                   "(tiny: 0; paper recipe: 0.1, the official 0.2 format reward next to its 2.0 for a right answer)")
    p.add_argument("--reward", default=None, choices=["strict", "lenient"], help="grading of the training reward: "
                   "strict = the answer only where the prompt asks for it, as the official reward; lenient also "
                   "reads the last number (tasks.grade) (tiny: lenient; paper recipe: strict)")
    p.add_argument("--prompt", default="ours", choices=list(tasks.PROMPT_STYLES), help="how problems are asked, in "
                   "training and held-out evaluation (tasks.PROMPTS): ours, our instruction; paper, as the code of "
                   "the paper's time (think tags, then ####); official, the think/answer system prompt; bare, the "
                   "question alone")
    # AQN (QeRL: 10 stages, sigma 1e-2 -> 1e-4 in the official scripts, 5e-4 in the paper's text; stage 0 noise-free)
    p.add_argument("--no-aqn", action="store_true", help="disable Adaptive Quantization Noise")
    p.add_argument("--aqn-stages", type=int, default=10, help="number of noise stages over the run")
    p.add_argument("--sigma-start", type=float, default=1e-2, help="AQN sigma at stage 1")
    p.add_argument("--sigma-end", type=float, default=1e-4, help="AQN sigma at the last stage (official scripts; the "
                   "paper's text says 5e-4)")
    p.add_argument("--aqn-update", action="store_true", help="also apply the step's noise during the update pass")
    # evaluation, logging, checkpoints
    p.add_argument("--eval-every", type=int, default=None, help="held-out evaluation every N steps (0 = start and end only)")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out items (tiny: 256; default 500)")
    p.add_argument("--eval-samples", type=int, default=1, help="samples per held-out item (accuracy = mean over them)")
    p.add_argument("--eval-temperature", type=float, default=None, help="held-out sampling temperature (tiny: 1.0; paper: 0.6)")
    p.add_argument("--eval-top-p", type=float, default=None, help="held-out nucleus sampling (tiny: 1.0; paper: 0.95)")
    p.add_argument("--eval-max-new-tokens", type=int, default=None, help="held-out completion budget (default --max-new-tokens)")
    p.add_argument("--log-samples", type=int, default=2, help="completions per step written to samples.jsonl")
    p.add_argument("--plot-every", type=int, default=5, help="refresh curves.png every N steps")
    p.add_argument("--save-every", type=int, default=10, help="checkpoint every N steps (0 = only at the end)")
    p.add_argument("--out", default=None, help="output folder (default runs/<timestamp>-<run id>): new or empty; a "
                   "folder holding an earlier run is refused (continue it with --resume, or replace it with --force)")
    p.add_argument("--force", action="store_true", help="start a new run in a non-empty --out, deleting what it holds "
                   "(never the current folder, one holding it, or the model)")
    p.add_argument("--resume", default=None, help="continue the run in this folder from its checkpoint, with its settings "
                   "(args.json). Options that do not change what is learned may be given: " + ", ".join(
                       f"--{k.replace('_', '-')}" for k in sorted(RESUMABLE - {"force"})) + "; a larger --steps extends a "
                   "run, finished or not, its extra steps at the end of the schedules (lr at its floor, AQN's last "
                   "sigma). Any other option that differs from the run's is refused.")
    p.add_argument("--log", default=None, choices=["tensorboard", "wandb"], help="also send the metrics to TensorBoard "
                   "(OUT/tensorboard) or Weights & Biases (offline unless WANDB_MODE=online); optional packages, off "
                   "by default")
    return p


def parse_args(argv=None):
    p = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        show_recipe(p, [a for a in argv if a not in ("-h", "--help")])
    return p.parse_args(argv)


def show_recipe(parser, argv):
    """--help with --model / --algo / --quant: each option that recipe() fills says the value it takes for
    them, so `train.py --model qwen2.5-7b --algo dapo --help` prints the recipe it would run."""
    known, _ = parser.parse_known_args(argv)
    resolved = recipe(argparse.Namespace(**vars(known)))
    which = f"--model {known.model} --algo {known.algo} --quant {known.quant}"
    for action in parser._actions:
        value = getattr(resolved, action.dest, None) if action.default is None else None
        if value is not None and action.help:
            action.help += f" [{which}: {value}]".replace("%", "%%")


# What --resume lets a user change: how long the run goes on, how often it logs, evaluates and saves,
# and how each step's work is laid out on the device (the same sums, so the same run).
RESUMABLE = {"steps", "eval_every", "save_every", "plot_every", "log_samples", "log", "micro_batch", "logp_chunk",
             "checkpointing", "no_compile", "device", "force"}


def recipe(args):
    """Fill the model-dependent defaults: the tiny CPU demo, or the paper's GPU recipe."""
    tiny = is_tiny(args.model)
    fill = {
        "data": "arith" if tiny else "gsm8k",
        # A GPU would run the tiny model in bf16 (on the CPU: fp32), a different run from the one the
        # README and the tests measured (how it differed on a GPU: results/rollout_h200.md).
        "device": "cpu" if tiny else None,
        "steps": 30 if tiny else 500,
        "prompts": 16,
        "max_new_tokens": 64 if tiny else 2048,
        "micro_batch": 128 if tiny else 8,
        # The tiny model learns from scratch-level signal in minutes only with a large LoRA lr;
        # the paper's values are for 7B+ models (QeRL: 1e-5 NVFP4, 5e-6 bf16).
        "lr": 2e-3 if tiny else (1e-5 if args.quant == "nvfp4" else 5e-6),
        "eval_limit": 256 if tiny else 500,
        "eval_temperature": 1.0 if tiny else 0.6,
        "eval_top_p": 1.0 if tiny else 0.95,
        "eval_every": 10 if tiny else 50,
        # The tiny run keeps the floor it was tuned with (a final lr of 0 would waste its last steps).
        "min_lr_ratio": 0.1 if tiny else 0.0,
        "reward": "lenient" if tiny else "strict",
        # (rank 16 learned half as much in the tiny run's first 10 steps: tests/test_train.py's short run)
        "lora_rank": 32 if tiny else 16,
        "lora_alpha": 32 if tiny else 16,
        "format_reward": 0.0 if tiny else 0.1,
        "eps_high": 0.28 if args.algo == "dapo" else 0.2,
        "beta": 0.0 if args.algo == "dapo" else 0.04,
        "loss_agg": "token-mean" if args.algo == "dapo" else "seq-mean-token-mean",
    }
    for k, v in fill.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.eval_data is None and args.data in TEST_SETS:
        args.eval_data = args.data  # (a file, or a set without a test split: none; check_args asks for one)
    if args.eval_max_new_tokens is None:
        args.eval_max_new_tokens = args.max_new_tokens
    if args.warmup_steps is None:  # (tiny: 5%, one step of 30; the official warmup_ratio 0.1 otherwise)
        args.warmup_steps = max(1, args.steps // 20) if tiny else max(1, math.ceil(0.1 * args.steps))
    if args.overlong_buffer is None:  # the official reward has no length term: truncation is masked instead
        args.overlong_buffer = args.max_new_tokens // 5 if args.algo == "dapo" and tiny else 0
    return args


def is_tiny(model):
    """Whether --model names the bundled tiny policy: its alias in any case, or its folder by any path."""
    target = hub.ALIASES.get(model.lower(), model)
    return os.path.realpath(target) == os.path.realpath(hub.ALIASES["tiny"])


def _finite(x):
    return isinstance(x, (int, float)) and math.isfinite(x)


def _have(package):
    return package in sys.modules or importlib.util.find_spec(package) is not None


def check_args(args):
    """Every bad value fails here, in one message that names each and says what is allowed, before any
    model is loaded or any folder written."""
    problems = []
    at_least = {"steps": 1, "prompts": 1, "group_size": 2, "max_new_tokens": 1, "micro_batch": 1, "logp_chunk": 1,
                "update_passes": 1, "max_sampling_rounds": 1, "aqn_stages": 2, "eval_limit": 1, "eval_samples": 1,
                "eval_max_new_tokens": 1, "lora_rank": 1, "plot_every": 1, "warmup_steps": 0, "eval_every": 0,
                "save_every": 0, "log_samples": 0}
    why = {"group_size": " (group-relative advantages need G >= 2)", "lora_rank": " (the adapters' rank r)",
           "aqn_stages": " (stage 0 is noise-free)"}
    for k, low in at_least.items():
        v = getattr(args, k)
        if not isinstance(v, int) or v < low:
            problems.append(f"--{k.replace('_', '-')} {v}: must be an integer >= {low}{why.get(k, '')}")
    # (each check is written so that nan fails it)
    positive = {"lr": "the peak learning rate", "lora_alpha": "LoRA's alpha", "grad_clip": "the gradient-norm clip",
                "tis_cap": "the cap C of --ratio tis"}
    for k, what in positive.items():
        v = getattr(args, k)
        if not (_finite(v) and v > 0):
            problems.append(f"--{k.replace('_', '-')} {v}: {what} must be a finite number > 0")
    if not (_finite(args.temperature) and args.temperature > 0):
        problems.append(f"--temperature {args.temperature}: must be a finite number > 0 for RL (the policy's "
                        f"logprobs use it)")
    if not (_finite(args.eval_temperature) and args.eval_temperature >= 0):
        problems.append(f"--eval-temperature {args.eval_temperature}: must be a finite number >= 0 (0 = greedy)")
    for k in ("top_p", "eval_top_p"):
        if not (_finite(getattr(args, k)) and 0 < getattr(args, k) <= 1):
            problems.append(f"--{k.replace('_', '-')} {getattr(args, k)}: must be in (0, 1]")
    for k, hi in (("min_lr_ratio", 1), ("lora_dropout", 0.999999), ("adam_beta2", 0.999999)):
        if not (_finite(getattr(args, k)) and 0 <= getattr(args, k) <= hi):
            problems.append(f"--{k.replace('_', '-')} {getattr(args, k)}: must be in [0, 1{')' if hi < 1 else ']'}")
    for k in ("weight_decay", "eps_low", "eps_high", "beta", "sigma_start", "sigma_end", "format_reward"):
        if not (_finite(getattr(args, k)) and getattr(args, k) >= 0):
            problems.append(f"--{k.replace('_', '-')} {getattr(args, k)}: must be a finite number >= 0")
    if _finite(args.format_reward):  # (e.g. a format weight with --prompt bare, which asks for no form)
        try:
            tasks.check_reward(args.reward, signed=args.signed_reward, format_weight=args.format_reward,
                               prompt=args.prompt)
        except ValueError as e:
            problems.append(f"--reward {args.reward}: {e}")
    if isinstance(args.overlong_buffer, int) and isinstance(args.max_new_tokens, int) and \
            not 0 <= args.overlong_buffer <= args.max_new_tokens:
        problems.append(f"--overlong-buffer {args.overlong_buffer} must be within [0, --max-new-tokens]")
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    unknown = [t for t in targets if t not in lora.TARGETS]
    if not targets or unknown:
        problems.append(f"--lora-targets {args.lora_targets}: {', '.join(unknown) or 'nothing'} matches no linear of "
                        f"the model; choose among {','.join(lora.TARGETS)}")
    named = lambda name: name in DATASETS  # (anything else is read as a file)
    if named(args.data) and args.data not in TRAIN_SETS:
        only = ", ".join(sorted(_splits(DATASETS[args.data][1])))
        problems.append(f"--data {args.data} has no train split (only {only}); train on {', '.join(TRAIN_SETS)} or a "
                        f".jsonl file, and evaluate on it with --eval-data {args.data}")
    choices = f"pass --eval-data FILE or a named test set ({', '.join(TEST_SETS)})"
    if args.eval_data is None and named(args.data):  # (recipe defaults it to a named set's test split)
        problems.append(f"--data {args.data} has no test split to evaluate on: {choices}")
    elif args.eval_data is None:  # (a file has no splits: the held-out evaluation would grade trained items)
        problems.append(f"--data {args.data} is read as a file, whose items are what the run trains on: {choices} "
                        f"for the held-out evaluation")
    elif named(args.eval_data) and args.eval_data not in TEST_SETS:
        problems.append(f"--eval-data {args.eval_data} has no test split; pass a .jsonl file or one of "
                        f"{', '.join(TEST_SETS)}")
    for name in dict.fromkeys(n for n in (args.data, args.eval_data) if n is not None and not named(n)):
        if not os.path.isfile(name):
            problems.append(f"no data file at {name} (nor a named set: {', '.join(DATASETS)})")
    if args.fp8_update and args.quant != "nvfp4":
        problems.append("--fp8-update runs an NVFP4 base's GEMMs in FP8; with --quant bf16 drop it")
    if args.log and not _have("tensorboard" if args.log == "tensorboard" else "wandb"):
        package = "tensorboard" if args.log == "tensorboard" else "wandb"
        problems.append(f"--log {args.log} needs the optional package {package}: pip install {package} (or drop --log)")
    if args.resume and find_checkpoint(args.resume) is None:
        problems.append(f"--resume {args.resume}: no checkpoint/ folder in it (still running, or stopped before its "
                        f"first checkpoint): nothing to resume; start it over with --out {args.resume} --force "
                        f"instead of --resume (which deletes what it holds), or name a new --out")
    if problems:
        sys.exit("train.py: " + "\n  ".join(["cannot start:"] + problems))


# ---------------------------------------------------------------------------------------------
# Log-probabilities of completion tokens, in chunks
# ---------------------------------------------------------------------------------------------

def _chunk_logp(h, weight, targets, temperature):
    logits = (h @ weight.t()).float() / temperature  # (C, V)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)  # (C,)
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # (C,)
    return logp, entropy


def shared_prompts(prompts):
    """For each row, how many leading tokens it shares with the row before: its prompt's length where the
    prompts are the same (the samples of one prompt), else 0."""
    return [len(p) if i and p == prompts[i - 1] else 0 for i, p in enumerate(prompts)]


def completion_logprobs(model, prompts, completions, lengths, temperature, chunk):
    """Logprobs (and entropies) of each completion token under softmax(logits / temperature).

    prompts: list of token lists; completions (B, Tc) right-padded; lengths (B,). Returns logp and
    entropy (B, Tc), zero past each length. A row whose prompt is the row before's (the samples of a
    prompt) reads that prompt's states instead of running it again (Transformer.shared_prompt_hidden).
    Only completion positions go through lm_head, `chunk` tokens at a time, each chunk recomputed in
    backward (checkpoint) so its float32 logits are freed."""
    B, Tc = completions.shape
    device = model.device
    seqs = [p + completions[i, : lengths[i]].tolist() for i, p in enumerate(prompts)]
    T = max(len(s) for s in seqs)
    tokens = torch.zeros(B, T, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)  # right padding, which the model never runs
    h = model.shared_prompt_hidden(tokens.to(device), list(map(len, seqs)), shared_prompts(prompts))  # (B, T, H)
    rows = torch.cat([torch.full((int(n),), i) for i, n in enumerate(lengths)])  # (N,)
    cols = torch.cat([torch.arange(int(n)) for n in lengths])  # (N,) completion index j
    pos = torch.tensor([len(prompts[i]) - 1 for i in rows.tolist()]) + cols  # hidden state that predicts token j
    targets = completions[rows, cols].to(device)  # (N,)
    rows, cols = rows.to(device), cols.to(device)
    hs = h[rows, pos.to(device)]  # (N, H)
    weight = model.lm_head.weight
    parts = [torch.utils.checkpoint.checkpoint(_chunk_logp, hs[s:s + chunk], weight, targets[s:s + chunk],
                                               temperature, use_reentrant=False)
             for s in range(0, hs.shape[0], chunk)]
    logp = torch.zeros(B, Tc, device=device)
    entropy = torch.zeros(B, Tc, device=device)
    logp = logp.index_put((rows, cols), torch.cat([p[0] for p in parts]))
    entropy[rows, cols] = torch.cat([p[1] for p in parts]).detach()
    return logp, entropy


# ---------------------------------------------------------------------------------------------
# Checkpoints: atomic, resumable
# ---------------------------------------------------------------------------------------------

def rng_state():
    """Every RNG the run draws from, as tensors and JSON numbers (a checkpoint holds nothing else, so
    loading one can never run code): (tensors, json)."""
    version, words, gauss = random.getstate()  # words: MT19937's 624 words and its position
    np_state = np.random.get_state(legacy=False)
    tensors = {"torch": torch.get_rng_state(), "python": torch.tensor(words, dtype=torch.int64),
               "numpy": torch.from_numpy(np_state["state"]["key"].astype(np.int64))}
    if torch.cuda.is_available():
        tensors["cuda"] = torch.cuda.get_rng_state_all()
    meta = {"python_version": version, "python_gauss": gauss, "numpy_pos": int(np_state["state"]["pos"]),
            "numpy_has_gauss": int(np_state["has_gauss"]), "numpy_gauss": float(np_state["gauss"])}
    return tensors, meta


def set_rng_state(tensors, meta):
    random.setstate((meta["python_version"], tuple(tensors["python"].tolist()), meta["python_gauss"]))
    np.random.set_state({"bit_generator": "MT19937", "state": {"key": tensors["numpy"].numpy().astype(np.uint32),
                                                               "pos": meta["numpy_pos"]},
                         "has_gauss": meta["numpy_has_gauss"], "gauss": meta["numpy_gauss"]})
    torch.set_rng_state(tensors["torch"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(tensors["cuda"])


def save_checkpoint(out, model, optimizer, scheduler, state):
    """Write out/checkpoint atomically: build it in checkpoint.tmp, then swap it in by renames; the one
    before stays as checkpoint.old, to fall back on if this one is ever found damaged. Signals that would
    kill the process are held off during the swap. What it holds: adapter/ (PEFT), state.pt (the
    optimizer's and scheduler's state and the RNGs: tensors, numbers, lists, which torch.load's
    weights_only=True reads) and state.json (`state`: step, data position, ...)."""
    tmp, final, old = (os.path.join(out, n) for n in ("checkpoint.tmp", "checkpoint", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    adapters.save_adapter(model, os.path.join(tmp, "adapter"))
    rng, rng_meta = rng_state()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng},
               os.path.join(tmp, "state.pt"))
    hub.write_json(os.path.join(tmp, "state.json"), {**state, "rng": rng_meta})
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if os.path.exists(final):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def find_checkpoint(out):
    """The newest checkpoint folder to resume from, or None: checkpoint/, else checkpoint.old/ (which
    is all there is after a crash between save_checkpoint's two renames)."""
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(out, name)
        if os.path.exists(os.path.join(path, "state.pt")):
            return path
    return None


def read_checkpoint(path, run_id=None):
    """(state.json merged with state.pt) of one checkpoint folder, checked whole: its state, its adapter,
    and that it belongs to the run `run_id` (args.json's). Raises ValueError naming the file otherwise.
    state.pt is read with weights_only=True: tensors and plain values only, so a crafted file cannot
    run code here; it is refused instead."""
    pt, js = os.path.join(path, "state.pt"), os.path.join(path, "state.json")
    try:
        tensors = torch.load(pt, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if "global" in str(e).lower():  # torch refused a reference to code (GLOBAL), not a damaged file
            raise ValueError(f"{pt} holds objects other than tensors and plain values (pickled code, or a "
                             f"checkpoint of an older train.py), which --resume never loads") from None
        raise ValueError(f"{pt} is damaged or not a checkpoint ({type(e).__name__}: {str(e)[:200]})") from None
    except Exception as e:
        raise ValueError(f"{pt} is damaged or not a checkpoint ({type(e).__name__}: {str(e)[:200]})") from None
    try:
        with open(js) as f:
            state = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{js} is missing or damaged ({type(e).__name__}: {e})") from None
    if not isinstance(tensors, dict) or not {"optimizer", "scheduler", "rng"} <= set(tensors):
        raise ValueError(f"{pt} is not a train.py checkpoint (it lacks the optimizer, scheduler or RNG state)")
    if state.get("run_id") != run_id:
        raise ValueError(f"{path} belongs to another run (its run id {state.get('run_id')} is not args.json's "
                         f"{run_id}); a run resumes only from checkpoints it wrote")
    adapters.read_adapter(os.path.join(path, "adapter"))  # (raises naming the file)
    return {**state, "json_rng": state.get("rng"), **tensors}


def load_checkpoint(out, run_id=None):
    """(path, state) of the newest readable checkpoint of the run in `out`: checkpoint/, or
    checkpoint.old/ when the newer one is damaged (said on stderr). Raises ValueError naming each file
    when there is none."""
    problems = []
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(out, name)
        if not os.path.exists(os.path.join(path, "state.pt")):
            continue
        try:
            state = read_checkpoint(path, run_id)
        except ValueError as e:
            problems.append(str(e))
            continue
        if problems:
            print(f"train.py: {problems[-1]}; resuming from the checkpoint before it, {path}", file=sys.stderr)
        return path, state
    if not problems:
        raise FileNotFoundError(f"no complete checkpoint in {out}")
    raise ValueError("cannot resume: " + "; ".join(problems) + ". Start the run again without --resume "
                     "(in a new --out, or with --force)")


def truncate_jsonl(path, keep):
    """Keep the first `keep` lines: a resumed run rewrites the steps after its checkpoint."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        lines = f.readlines()[:keep]
    with open(path + ".tmp", "w") as f:
        f.writelines(lines)
    os.replace(path + ".tmp", path)


# ---------------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------------

PLOTS = [("reward", "reward"), ("accuracy", "rollout accuracy"), ("heldout_accuracy", "held-out accuracy"),
         ("entropy", "entropy"), ("response_length", "response length"), ("sigma", "AQN sigma")]


def plot(rows, path, baseline=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    for ax, (key, title) in zip(axes.flat, PLOTS):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        if key == "heldout_accuracy":  # measured after the step: plot it at step + 1, from the baseline at 0
            pts = [(0, baseline)] * (baseline is not None) + [(s + 1, v) for s, v in pts]
        if pts:
            ax.plot(*zip(*pts), marker="o" if key == "heldout_accuracy" else None, markersize=3)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=90)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------

class PromptStream:
    """Training prompts in a seeded random order, epoch after epoch; `pos` is all the state."""

    def __init__(self, items, seed, pos=0):
        self.items, self.seed, self.pos = items, seed, pos
        self.epoch, self.order = None, None  # the current epoch's permutation, derived from seed + epoch

    def take(self, n):
        out = []
        for _ in range(n):
            epoch, i = divmod(self.pos, len(self.items))
            if epoch != self.epoch:
                self.epoch, self.order = epoch, np.random.default_rng(self.seed + epoch).permutation(len(self.items))
            out.append(self.items[self.order[i]])
            self.pos += 1
        return out


def training_batch(groups, encode, device):
    """Flatten the kept groups into one batch: prompts, completions (B, Tc), lengths (B,), the
    behaviour policy's logprobs (B, Tc), finish reasons."""
    pick = [(g, r) for g in groups for r in g["rows"]]
    lens = torch.stack([g["rollout"].lengths[r] for g, r in pick]).cpu()  # (B,)
    Tc = int(lens.max())
    pad = lambda t: torch.nn.functional.pad(t[:Tc], (0, max(0, Tc - t.shape[0])))
    completions = torch.stack([pad(g["rollout"].tokens[r]) for g, r in pick]).cpu()  # (B, Tc)
    old = torch.stack([pad(g["rollout"].logprobs[r]) for g, r in pick]).to(device)  # (B, Tc)
    prompts = [encode(g["item"]) for g, _ in pick]
    truncated = torch.tensor([g["rollout"].finish[r] == "length" for g, r in pick])
    return prompts, completions, lens, old, truncated


def update(args, model, optimizer, params, groups, rewards, encode, sigma, noise_seed, gen_device, world=ddp.World()):
    """One or more passes of the clipped policy-gradient loss over the step's batch, in micro-batches
    whose losses add up to the full batch's (grpo.policy_loss with the full batch's counts).

    groups and rewards (groups, G) are the global batch's; this rank trains on the groups it sampled (those
    with a rollout), with the global batch's counts as divisors, and the gradients are summed over the
    ranks before the clip: the update of one process over the whole batch (ddp.py says why)."""
    device = model.device
    adv = grpo.group_advantages(rewards, std=args.adv_std)  # (groups, G): a group's own (--adv-std batch: all)
    mine = [i for i, g in enumerate(groups) if g["rollout"] is not None]
    adv = adv[mine].flatten().to(device)  # (B,) this rank's rows
    slices, local = [], (0, 0)
    if mine:
        prompts, completions, lens, old, truncated = training_batch([groups[i] for i in mine], encode, device)
        mask = (torch.arange(completions.shape[1])[None] < lens[:, None]).float()  # (B, Tc)
        if args.mask_truncated:  # (after the advantages: a truncated sample still counts in its group's mean and std)
            mask = dapo.apply_overlong_filter(mask, truncated)
        mask = mask.to(device)
        local = grpo.batch_counts(mask)
        slices = micro_batches(model.config, model.dtype, prompts, lens, args.micro_batch, args.max_new_tokens)
    num_seqs, num_tokens = ddp.counts(*local, world, device)
    need = max([micro_batch_bytes(model.config, model.dtype, prompts[sl], lens[sl]) for sl in slices], default=0)
    model.gradient_checkpointing = checkpointing_on(args, model, need)
    model.train()
    out, first = {}, {}  # first: each micro-batch's trainer logp in the first pass (the policy before the update)
    for p in range(args.update_passes):
        optimizer.zero_grad(set_to_none=True)
        sums = {}
        with aqn.noise(model, sigma if args.aqn_update else 0.0, torch.Generator(gen_device).manual_seed(noise_seed)), \
                fp4_gemm.fp8_tensor_cores(args.fp8_update):
            for i, sl in enumerate(slices):
                ref = None
                if args.beta > 0:  # the reference policy is the base model: the same weights, adapters off. (First:
                    # disable_adapters swaps trained norms in place, which a pending backward would refuse.)
                    with torch.no_grad(), lora.disable_adapters(model):
                        ref, _ = completion_logprobs(model, prompts[sl], completions[sl], lens[sl], args.temperature, args.logp_chunk)
                logp, ent = completion_logprobs(model, prompts[sl], completions[sl], lens[sl], args.temperature, args.logp_chunk)
                if p == 0 and args.update_passes > 1:
                    first[i] = logp.detach()
                # old: the sampler's logprobs (--ratio sampler) or the trainer's own before this update (trainer,
                # tis); is_weight: tis's truncated pi_trainer / pi_sampler (grpo.sampler_correction)
                old_logp, is_weight = grpo.sampler_correction(args.ratio, logp, old[sl], args.tis_cap, first.get(i) if p else None)
                loss, lm = grpo.policy_loss(logp, old_logp, adv[sl], mask[sl], eps_low=args.eps_low, eps_high=args.eps_high,
                                            ref_logp=ref, beta=args.beta, agg=args.loss_agg, num_seqs=num_seqs,
                                            num_tokens=num_tokens, const=args.max_new_tokens, entropy=ent,
                                            is_weight=is_weight, sampler_logp=old[sl], tis_cap=args.tis_cap)
                loss.backward()
                # Loss parts already add up across micro-batches; per-token means are re-weighted by tokens; a
                # maximum is the largest of the micro-batches'.
                w = lm["tokens"] / max(1, num_tokens)
                for k, v in lm.items():
                    if k.endswith("_max"):
                        sums[k] = max(sums.get(k, v), v)
                    elif k not in ("tokens", "seqs"):
                        sums[k] = sums.get(k, 0.0) + (v if k in ("loss", "pg_loss", "kl_loss") else v * w)
        ddp.all_reduce_grads(params, world)  # (the sum over the ranks: the global loss's gradient, on every rank)
        sums = ddp.reduce_metrics(sums, world)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        if not torch.isfinite(grad_norm):
            tqdm.write(f"non-finite loss or gradient (grad norm {grad_norm}); skipping this update")
            optimizer.zero_grad(set_to_none=True)
            out["skipped"] = True
        else:
            optimizer.step()
        out.update(sums, grad_norm=float(grad_norm))
    out["checkpointing"] = int(model.gradient_checkpointing)
    return out


def activation_bytes(cfg, tokens, dtype, attended=0):
    """About what a forward over `tokens` tokens keeps for backward without activation checkpointing. Per
    token and layer: each RMSNorm's input and output, q and the attention output (6 hidden-size vectors),
    k and v, gate, up and their product (3 intermediate-size vectors); LoRA keeps the inputs of its A's,
    which are among these, and the frozen base weights need none. `attended`: tokens that attention alone
    sees on top (model.shared_prompt_attention: a shared prompt again for each further sample, the
    padding), which hold their q, k, v and output there too. The estimate against measured peaks:
    results/bench_h200.md."""
    per_token = 6 * cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim + 3 * cfg.intermediate_size
    per_attended = 2 * cfg.hidden_size + 2 * cfg.num_kv_heads * cfg.head_dim
    return (tokens * per_token + attended * per_attended) * cfg.num_layers * torch.finfo(dtype).bits // 8


def micro_batch_bytes(cfg, dtype, prompts, lengths):
    """activation_bytes of one micro-batch (prompts, completion lengths) as completion_logprobs runs it: a
    packed row of each prompt once for its samples and no padding, attention seeing the padded whole
    sequences on top."""
    seqs = [len(p) + int(n) for p, n in zip(prompts, lengths)]
    packed = sum(seqs) - sum(shared_prompts(prompts))
    return activation_bytes(cfg, packed, dtype, attended=len(seqs) * max(seqs) - packed)


def micro_batches(cfg, dtype, prompts, lengths, size, max_new_tokens):
    """The update's micro-batches: consecutive slices of the batch. `size` sequences a slice where every
    completion runs to max_new_tokens (--micro-batch means what it says there); where they stop early, as
    real ones do, a slice takes the next sequence while its activations (micro_batch_bytes) stay within
    the largest that a slice of `size` sequences of these prompts needs at that limit, so more sequences
    share each forward and backward in no more memory. That pays where a micro-batch is short work for the
    GPU, whose time then goes to the gaps between kernels (measured: results/bench_h200.md)."""
    at_limit = lambda start: micro_batch_bytes(cfg, dtype, prompts[start:start + size], [max_new_tokens] * size)
    budget = max(map(at_limit, range(0, len(prompts), size)))
    slices, start = [], 0
    while start < len(prompts):
        end = start + 1
        while end < len(prompts) and micro_batch_bytes(cfg, dtype, prompts[start:end + 1], lengths[start:end + 1]) <= budget:
            end += 1
        slices.append(slice(start, end))
        start = end
    return slices


def checkpointing_on(args, model, need):
    """Whether the update recomputes each block in backward (model.gradient_checkpointing). `auto`: only
    where the largest micro-batch's activations (`need` bytes, activation_bytes) would not otherwise fit,
    with 10% and 1 GiB to spare, in what this process can still allocate on its GPU (free memory and
    torch's idle cache, within any per-process cap). Recomputing adds a forward, about a third of the
    pass's GEMM work (what it cost a 7B step: results/bench_h200.md). On the CPU
    (the tiny demo, the tests) `auto` keeps it on: memory there is not measured. The gradients are the
    same either way."""
    if args.checkpointing != "auto" or model.device.type != "cuda":
        return args.checkpointing != "off"
    dev = model.device
    free, total = torch.cuda.mem_get_info(dev)
    used = torch.cuda.memory_allocated(dev)
    idle = torch.cuda.memory_reserved(dev) - used
    cap = getattr(torch.cuda, "get_per_process_memory_fraction", lambda d: 1.0)(dev) * total - used
    return 1.1 * need + 2**30 > min(free + idle, cap)


def lr_lambda(args):
    def f(step):
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        # (over the run's first --steps: steps that --resume adds stay at the floor)
        total = getattr(args, "schedule_steps", None) or args.steps
        t = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
        return args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


def compile_backend(device, no_compile):
    """The torch.compile backend for the update's blocks (model.compile_blocks): inductor on a GPU unless
    --no-compile; none on the CPU, where the default tiny run and the tests stay eager."""
    return "inductor" if device.type == "cuda" and not no_compile else None


def saved_args(run_dir):
    """The settings a run was started with (its args.json), for --resume; options added to train.py
    since then take their defaults."""
    saved = os.path.join(run_dir, "args.json")
    if not os.path.exists(saved):
        sys.exit(f"train.py: cannot resume {run_dir}: no args.json in it")
    try:
        with open(saved) as f:
            stored = json.load(f)
    except ValueError as e:
        sys.exit(f"train.py: cannot resume {run_dir}: {saved} is damaged ({e})")
    return argparse.Namespace(**{**vars(parse_args([])), **stored, "resume": run_dir})


def explicit_options(argv):
    """The options given on the command line (not defaulted), as parse_args reads them."""
    p = build_parser()
    for action in p._actions:
        action.default = argparse.SUPPRESS
    return vars(p.parse_args(argv))


def resume_args(argv):
    """--resume DIR: the run's own settings (args.json), with what RESUMABLE lets the command line change.
    Any other option given with a value that differs from the run's stops here, naming each."""
    given = explicit_options(argv)
    run_dir = given["resume"]
    args = saved_args(run_dir)
    if given.get("out") not in (None, run_dir) and os.path.realpath(given["out"]) != os.path.realpath(run_dir):
        sys.exit(f"train.py: --resume {run_dir} writes into {run_dir}; drop --out {given['out']} (or start a new run "
                 f"there without --resume)")
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


def default_out(run_id):
    """runs/<timestamp>-<the run id's first 6 hex digits>: unique for runs started in the same second."""
    return os.path.join("runs", f"{time.strftime('%Y%m%d-%H%M%S')}-{run_id[:6]}")


def started_run(out):
    """Whether a train.py run was started in `out`, finished or not, perhaps still running: its marker
    names a run id (prepare_out's first write), or it holds a run's args.json, checkpoint or metrics."""
    metrics = os.path.join(out, "metrics.jsonl")
    return bool(hub.read_marker(out).get("run_id") or os.path.exists(os.path.join(out, "args.json")) or find_checkpoint(out)
                or (os.path.exists(metrics) and os.path.getsize(metrics) > 0))


def summary_steps(out):
    """The step count of the run's summary.json (written when a run of that many steps finished), or None."""
    try:
        steps = hub.read_json(os.path.join(out, "summary.json")).get("steps")
    except (OSError, ValueError):
        return None
    return steps if isinstance(steps, int) else None


def prepare_out(args):
    """The run's folder: --resume's, or a new one that holds no earlier run (hub.check_out's rules, and a
    folder where a train.py run was started only with --force, which deletes it first), marked as train.py's.
    A resumed run's summary.json, the shorter run's when --steps extends it, moves aside as
    summary.<its steps>-steps.json: summary.json always describes the run that ends in this folder."""
    if args.resume:
        summary = os.path.join(args.resume, "summary.json")
        if os.path.exists(summary):
            os.replace(summary, os.path.join(args.resume, f"summary.{summary_steps(args.resume) or 'unknown'}-steps.json"))
        hub.mark(args.resume, "train.py", run_id=getattr(args, "run_id", None))
        return args.resume
    out = args.out or default_out(args.run_id)
    state = hub.check_out(out, "train.py", sources=[read_config(args.model)[0]], force=args.force)
    if state == "ours" and started_run(out) and not args.force:
        if find_checkpoint(out):
            raise hub.OutputError(f"--out {out} holds an earlier run; continue it with --resume {out}, or pass "
                                  f"--force to delete it and start over, or name a new folder")
        raise hub.OutputError(f"--out {out} holds a run started earlier that has no checkpoint yet (it may still be "
                              f"running, or it stopped before its first: nothing to resume); pass --force to delete "
                              f"it and start over, or name a new folder")
    if state != "new":
        shutil.rmtree(out)  # (an earlier train.py run, or a folder --force lets go; never a new run in its files)
    hub.claim_folder(out, "train.py", force=args.force)
    hub.mark(out, "train.py", run_id=getattr(args, "run_id", None))
    return out


class Tracker:
    """--log: the metrics of every step also to TensorBoard (OUT/tensorboard) or Weights & Biases (offline
    unless WANDB_MODE says otherwise), for watching a run live; metrics.jsonl and curves.png stay the record.
    Both packages are optional: check_args refuses --log when the one asked for is missing."""

    def __init__(self, kind, out, args):
        self.kind, self.writer = kind, None
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(os.path.join(out, "tensorboard"))
        elif kind == "wandb":
            import wandb

            os.environ.setdefault("WANDB_MODE", "offline")  # (no network needed; `wandb sync` uploads later)
            self.writer = wandb.init(project="qerl", dir=out, name=os.path.basename(os.path.normpath(out)),
                                     id=getattr(args, "run_id", None), resume="allow", config=vars(args))

    def log(self, m, step):
        numbers = {k: float(v) for k, v in m.items() if k != "step" and isinstance(v, (int, float)) and math.isfinite(v)}
        if self.kind == "tensorboard":
            for k, v in numbers.items():
                self.writer.add_scalar(k, v, step)
            self.writer.flush()
        elif self.kind == "wandb":
            self.writer.log(numbers, step=step)

    def close(self):
        if self.writer is not None:
            (self.writer.close if self.kind == "tensorboard" else self.writer.finish)()


class WallTime:
    """The run's wall time over all its processes: OUT/wall_time.json lists each part's seconds (a run
    killed and resumed has several), this process's part updated as it goes."""

    def __init__(self, out, resume):
        self.path, self.t0 = os.path.join(out, "wall_time.json"), time.time()
        self.parts = []
        if resume and os.path.exists(self.path):
            with open(self.path) as f:
                self.parts = json.load(f).get("parts_s", [])
        self.parts.append(0.0)

    def update(self):
        self.parts[-1] = time.time() - self.t0
        hub.write_json(self.path, {"parts_s": self.parts})
        return sum(self.parts)


class PromptEncoder:
    """A problem's prompt tokens, as the task asks it (tasks.get_task: the chat template with --prompt's
    instruction); each question is encoded once and kept."""

    def __init__(self, tokenizer, kind, style):
        self.task, self.tokenizer, self.ids = tasks.get_task(kind, style), tokenizer, {}

    def __call__(self, item):
        q = item["question"]
        if q not in self.ids:
            self.ids[q] = self.task.prompt_ids(self.tokenizer, q)
        return self.ids[q]



def heldout_accuracy(args, model, tokenizer, items, kind, world):
    """The policy's held-out accuracy, graded leniently and strictly: eval.evaluate over `items`, its batch b
    sampled with seed + b. Under several ranks each runs some of the batches with those seeds, so the
    counts are the single-process ones (ddp.map_batches). → (accuracy, strict accuracy)."""
    model.eval()
    kw = dict(samples=args.eval_samples, temperature=args.eval_temperature, top_p=args.eval_top_p,
              max_new_tokens=args.eval_max_new_tokens, prompt=args.prompt)
    seed = args.seed + 1_000_003
    if world.size == 1:
        res = evaluate(model, tokenizer, items, kind, seed=seed, **kw)
        return res["accuracy"], res.get("accuracy_strict")
    # (the batches of evaluate's default size, so that the seeds match the single-process run's)
    per_batch = max(1, default_batch(model.device) // args.eval_samples)

    def right(b, start, end):
        recs = evaluate(model, tokenizer, items[start:end], kind, seed=seed + b,
                        batch_size=per_batch * args.eval_samples, **kw)["records"]
        return sum(r["correct"] for r in recs), sum(r["correct_strict"] for r in recs)

    counts = ddp.map_batches(len(items), per_batch, right, world)
    n = len(items) * args.eval_samples
    return sum(c[0] for c in counts) / n, sum(c[1] for c in counts) / n


class Sampler:
    """The rollout rounds of the run: what every round uses (the policy, its tokenizer and stop tokens, the
    prompt stream, the task), and `round`, one round of one step."""

    def __init__(self, args, model, tokenizer, stream, encode, kind, world):
        self.args, self.model, self.tokenizer, self.stream, self.encode = args, model, tokenizer, stream, encode
        self.kind, self.world, self.stop_ids = kind, world, stop_token_ids(tokenizer)

    def round(self, step, sigma, noise_seed, sampled_tokens, round_):
        """Round `round_` of step `step` (dapo.collect_informative calls it with the round alone: bind the
        rest with functools.partial). Every rank takes the round's --prompts global prompts and samples its
        block of them, [lo, hi) (all of them in one process), with AQN noise `sigma` on the norms; then every
        rank learns every group's rewards (ddp.gather_rows), so that dynamic sampling, the advantages and the
        logged means are the global batch's. Appends the round's sampled tokens to `sampled_tokens`.
        → (groups: dicts of item, rollout (this rank's, else None), rows, rewards and their parts, lengths,
        texts; correct (groups, G), by which DAPO filters: all right or all wrong carries no signal)."""
        args, model, world = self.args, self.model, self.world
        items = self.stream.take(args.prompts)
        G, (lo, hi) = args.group_size, ddp.shard(len(items), world)
        per_row = torch.zeros(4, len(items) * G)  # correct, format, overlong, length of each row; ours filled
        ro = texts = None
        if hi > lo:
            model.eval()
            gen_device = model.device if model.device.type == "cuda" else "cpu"
            with torch.no_grad(), aqn.noise(model, sigma, torch.Generator(gen_device).manual_seed(noise_seed)):
                # (keyed as rows lo*G... of the one-process call: the same samples on any number of ranks)
                ro = rollout.generate(model, [self.encode(it) for it in items[lo:hi]], n=G,
                                      max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_p=args.top_p, stop_ids=self.stop_ids,
                                      seed=ddp.shift_seed(args.seed * 7919 + step * 31 + round_, lo * G))
            texts = ro.texts(self.tokenizer)
            parts = [tasks.reward(self.kind, t, items[lo + i // G]["answer"], args.reward,
                                  signed=args.signed_reward, format_weight=args.format_reward, prompt=args.prompt)[1]
                     for i, t in enumerate(texts)]
            per_row[0, lo * G:hi * G] = torch.tensor([p["correct"] for p in parts])
            per_row[1, lo * G:hi * G] = torch.tensor([p["format"] for p in parts])
            # (buffer 0: the hard rule, zero up to max_new_tokens, which rollouts never pass)
            per_row[2, lo * G:hi * G] = dapo.overlong_penalty(ro.lengths.cpu(), args.max_new_tokens,
                                                              args.overlong_buffer, dtype=torch.float32)
            per_row[3, lo * G:hi * G] = ro.lengths.cpu().float()
        correct, fmt, over, lengths = ddp.gather_rows(per_row, world, model.device).view(4, len(items), G)
        sampled_tokens.append(int(lengths.sum()))
        total = correct + fmt + over  # (groups, G)
        ours = lambda g: lo <= g < hi
        groups = [dict(item=items[g], rollout=ro if ours(g) else None, rows=list(range((g - lo) * G, (g - lo + 1) * G)),
                       reward=total[g], correct=correct[g], format=fmt[g], overlong=over[g], lengths=lengths[g],
                       texts=texts[(g - lo) * G:(g - lo + 1) * G] if ours(g) else None) for g in range(len(items))]
        return groups, correct


def describe(args, model, norms, n_train, schedule, n_train_items, n_eval_items, world, device, out):
    """The start-up lines: the model and its weights, the step's shape and the optimizer, the data, the ranks."""
    weight_gb = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())) / 1e9
    kernels = f"; fp4 matmuls: {'Triton kernels' if device.type == 'cuda' else 'torch dequantize + matmul'}" \
        if args.quant == "nvfp4" else ""
    print(f"model {args.model} ({model.config}) base={args.quant} on {device} ({weight_gb:.3f} GB of weights{kernels}), "
          f"LoRA r={args.lora_rank}{f' + {len(norms)} norms' if norms else ''}: {n_train / 1e6:.2f}M trainable parameters")
    print(f"{args.algo}: {args.steps} steps x {args.prompts} prompts x G={args.group_size} = "
          f"{args.prompts * args.group_size} completions/step, <= {args.max_new_tokens} new tokens each; "
          f"lr {args.lr:g} (AdamW beta2 {args.adam_beta2}, wd {args.weight_decay}, {args.warmup_steps} warm-up steps, "
          f"clip {args.grad_clip}), eps {args.eps_low}/{args.eps_high}, beta {args.beta}, ratio {args.ratio}"
          f"{f' (cap {args.tis_cap:g})' if args.ratio == 'tis' else ''}, truncated {'masked' if args.mask_truncated else 'kept'}, AQN "
          f"{'off' if args.no_aqn else schedule}; data {args.data} ({n_train_items} train, {n_eval_items} held-out)")
    if world.size > 1:
        print(f"data-parallel: {world.size} ranks ({'NCCL' if device.type == 'cuda' else 'gloo'}), each sampling and "
              f"training about {args.prompts / world.size:g} of the {args.prompts} prompts a round; gradients summed "
              f"over the ranks (ddp.py)")
    print(f"outputs in {out}")


def step_metrics(step, sigma, stage, rounds, filtered, groups, rewards, lr):
    """A step's sampling metrics: its AQN sigma and stage, dynamic sampling's rounds and filtered groups, and
    the kept groups' mean reward (rewards (groups, G)), its parts and the rollout accuracy."""
    m = {"step": step, "sigma": sigma, "aqn_stage": stage, "rounds": rounds, "filtered_groups": filtered,
         "groups": len(groups), "lr": lr}
    if groups:
        correct = torch.stack([g["correct"] for g in groups])
        m.update(reward=rewards.mean().item(), reward_correct=correct.mean().item(),
                 reward_format=torch.stack([g["format"] for g in groups]).mean().item(),
                 reward_overlong=torch.stack([g["overlong"] for g in groups]).mean().item(),
                 accuracy=(correct > 0).float().mean().item())
    return m


def write_step(m, groups, texts, metrics_path, samples_path, log_samples):
    """Append the step's metrics line, and its first `log_samples` groups' first completions (texts: their
    texts, by group index, from the ranks that sampled them) to samples.jsonl."""
    with open(metrics_path, "a") as f:
        f.write(json.dumps(m) + "\n")
    with open(samples_path, "a") as f:
        for i, g in enumerate(groups[:log_samples]):
            f.write(json.dumps({"step": m["step"], "question": g["item"]["question"], "gold": g["item"]["answer"],
                                "completion": texts[i], "correct": float(g["correct"][0])}) + "\n")


def main(argv=None):
    args = resume_args(argv) if parse_args(argv).resume else parse_args(argv)
    if not args.resume:
        args.run_id = uuid.uuid4().hex  # checkpoints carry it: a run resumes only from its own
    args = recipe(args)
    if getattr(args, "schedule_steps", None) is None:  # the lr and AQN schedules' length: --steps at the start
        args.schedule_steps = args.steps
    check_args(args)
    device = resolve_device(args.device, "train.py")
    if args.fp8_update and not fp4_gemm.fp8_supported(device):
        sys.exit("train.py: --fp8-update needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                 f"Blackwell), and {torch.cuda.get_device_name(device)} has none: drop --fp8-update"
                 if device.type == "cuda" else "train.py: --fp8-update on the CPU needs torch._scaled_mm with one scale "
                 f"a row, which torch {torch.__version__} lacks there: run it on a GPU, or drop --fp8-update")
    # Under torchrun: this rank's place and device (ddp.py); a plain `python train.py` is World() and starts no
    # process group. Rank 0 names the run (its id, its folder) for all; only rank 0 writes or prints.
    world, device = ddp.init(device)
    if world.size > 1:
        args.run_id = getattr(args, "run_id", None) if args.resume else ddp.broadcast(args.run_id, world)
        if not world.main:
            sys.stdout = open(os.devnull, "w")  # (stderr stays: errors and warnings of every rank show)
    if not args.resume:
        args.out = ddp.broadcast(args.out or default_out(args.run_id), world)
    torch.manual_seed(args.seed)

    # The model's folder, the data, a resumed run's checkpoint and the output folder first: any of them
    # missing or malformed stops here, with what to do, before minutes of loading.
    with stop_on_bad_input("train.py"):
        model_dir = read_config(args.model)[0]
        train_items = load_dataset(args.data, split="train")  # (a file has no splits: all of it)
        eval_items = load_dataset(args.eval_data, split="test", limit=args.eval_limit)
        if not train_items:
            raise ValueError(f"{args.data} holds no problems")
        ckpt = state = None
        if args.resume:
            ckpt, state = load_checkpoint(args.resume, getattr(args, "run_id", None))
            # (finished: its summary is of a run that ended at the checkpoint's step, not a shorter one's)
            finished = summary_steps(args.resume) == state["step"]
            if state["step"] >= args.steps and (finished or state["step"] > args.steps):
                raise ValueError(f"--resume {args.resume}: the run has done {state['step']} steps; pass a larger "
                                 f"--steps with --resume to extend it")
        out = prepare_out(args) if world.main else (args.resume or args.out)
    wall = WallTime(out, args.resume) if world.main else None
    kind = train_items[0]["kind"]

    with stop_on_bad_input("train.py"):  # (a damaged weight file names itself)
        model, tokenizer = load_policy(model_dir, quant=args.quant, device=device)  # (bf16 on a GPU, fp32 on CPU)
    params = lora.apply_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                             targets=tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))
    norms = lora.train_norms(model) if args.train_norms else []  # (float32, updated in place: the rollout reads them)
    model.compile_blocks = compile_backend(device, args.no_compile)
    # Weight decay on LoRA only: decaying a norm weight pulls it towards 0, not towards its base value (the
    # HF Trainer of the official code exempts every norm weight by name).
    optimizer = torch.optim.AdamW([{"params": params}, {"params": norms, "weight_decay": 0.0}], lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, args.adam_beta2))
    params = params + norms  # (the gradient-norm clip covers both, as the official Trainer's does)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    schedule = aqn.AQNSchedule(args.schedule_steps, args.aqn_stages, args.sigma_start, args.sigma_end)
    encode = PromptEncoder(tokenizer, kind, args.prompt)
    heldout = functools.partial(heldout_accuracy, args, model, tokenizer, eval_items, kind, world)
    strict = {}  # step -> the strict grader's held-out accuracy, next to the lenient one logged

    step, stream, baseline, rows = 0, PromptStream(train_items, args.seed), None, []
    metrics_path, samples_path = os.path.join(out, "metrics.jsonl"), os.path.join(out, "samples.jsonl")
    if args.resume:
        with stop_on_bad_input("train.py"):
            adapters.load_adapter(model, os.path.join(ckpt, "adapter"))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"], state["json_rng"])
        step, stream.pos, baseline = state["step"], state["data_pos"], state["baseline_accuracy"]
        if world.main:
            truncate_jsonl(metrics_path, step)
            truncate_jsonl(samples_path, state["samples_lines"])
            with open(metrics_path) as f:
                rows = [json.loads(line) for line in f]
        changed = "; changed: " + ", ".join(f"--{k.replace('_', '-')} {a} -> {b}" for k, (a, b) in args.changed.items()) \
            if args.changed else ""
        print(f"resumed {out} at step {step} from {ckpt}, keeping its settings (args.json: model {args.model}, "
              f"{args.quant}, {args.algo}, data {args.data}, seed {args.seed}, lr {args.lr:g}, LoRA r {args.lora_rank}, "
              f"{args.prompts} prompts x G={args.group_size}){changed}")
        if step >= args.schedule_steps and args.steps > args.schedule_steps:
            print(f"steps {args.schedule_steps}..{args.steps - 1} extend the run at the schedules' end: lr "
                  f"{args.lr * args.min_lr_ratio:g}, AQN sigma {0.0 if args.no_aqn else schedule.sigma(args.schedule_steps - 1):.1e}")
    elif world.main:
        for p in (metrics_path, samples_path):
            open(p, "w").close()
    saved = {k: v for k, v in vars(args).items() if k not in ("changed", "force")}
    if world.main:
        hub.write_json(os.path.join(out, "args.json"), saved)
    tracker = Tracker(args.log if world.main else None, out, args)
    ddp.same_everywhere(params, world)  # (the same seed and checkpoint: the same parameters on every rank)
    sampler = Sampler(args, model, tokenizer, stream, encode, kind, world)

    describe(args, model, norms, sum(p.numel() for p in params), schedule, len(train_items), len(eval_items), world,
             device, out)
    if baseline is None:
        baseline, strict[0] = heldout()
        print(f"held-out accuracy before training: {baseline:.3f}")

    bar = tqdm(total=args.steps, initial=step, desc="RL", unit="step", dynamic_ncols=True, disable=not world.main)
    while step < args.steps:
        t0 = time.time()
        sigma = 0.0 if args.no_aqn else schedule.sigma(step)
        noise_seed = args.seed * 1_000_003 + step
        gen_device = device if device.type == "cuda" else "cpu"
        sampled_tokens = []  # every round's, kept or filtered: what the rollout time was spent on
        sample = functools.partial(sampler.round, step, sigma, noise_seed, sampled_tokens)
        if args.algo == "dapo" and not args.no_dynamic_sampling:
            groups, _, report = dapo.collect_informative(sample, args.prompts, args.max_sampling_rounds)
            filtered, rounds = report.groups_filtered, report.rounds
            if report.fell_short:
                tqdm.write(f"step {step}: dynamic sampling fell short: {report.groups_kept}/{args.prompts} informative "
                           f"groups after {report.rounds} rounds; training on those")
        else:
            groups, _ = sample(0)
            filtered, rounds = 0, 1
        rewards = torch.stack([g["reward"] for g in groups]) if groups else None  # (groups, G)
        t_rollout = time.time() - t0

        m = step_metrics(step, sigma, schedule.stage(step), rounds, filtered, groups, rewards, scheduler.get_last_lr()[0])
        update_metrics = update(args, model, optimizer, params, groups, rewards, encode, sigma, noise_seed, gen_device,
                                world) if groups else {}
        # The schedule counts steps, updated or skipped (no informative groups, a NaN): torch warns when it
        # advances before the optimizer's first step, which here is what is meant.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            scheduler.step()
        step += 1
        t_total = time.time() - t0
        lengths = torch.cat([g["lengths"] for g in groups]) if groups else torch.zeros(1)
        m.update(update_metrics, response_length=lengths.mean().item(), response_length_max=lengths.max().item(),
                 time_rollout=t_rollout, time_update=t_total - t_rollout, time_step=t_total,
                 rollout_tokens_per_s=sum(sampled_tokens) / max(t_rollout, 1e-9),
                 peak_memory_gb=(torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else peak_rss_gb()))
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            m["heldout_accuracy"], m["heldout_accuracy_strict"] = heldout()
        ddp.same_everywhere(params, world)
        # The texts of the groups logged to samples.jsonl, from the ranks that sampled them.
        logged = ddp.union({i: g["texts"][0] for i, g in enumerate(groups[: args.log_samples]) if g["texts"]}, world)
        if not world.main:
            bar.update(1)
            continue
        rows.append(m)
        write_step(m, groups, logged, metrics_path, samples_path, args.log_samples)
        tqdm.write(format_line(m))
        tracker.log(m, step - 1)
        wall.update()
        bar.update(1)
        if step % args.plot_every == 0:
            plot(rows, os.path.join(out, "curves.png"), baseline)
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            with open(samples_path) as f:
                samples_lines = sum(1 for _ in f)
            save_checkpoint(out, model, optimizer, scheduler, {"step": step, "data_pos": stream.pos,
                                                               "baseline_accuracy": baseline, "samples_lines": samples_lines,
                                                               "aqn_stage": schedule.stage(step),
                                                               "run_id": getattr(args, "run_id", None)})
    bar.close()

    final, strict[args.steps] = heldout()
    if not world.main:
        ddp.shutdown(world)
        return None
    rows[-1]["heldout_accuracy"] = final
    rows[-1]["heldout_accuracy_strict"] = strict[args.steps]
    tracker.log({"heldout_accuracy": final}, args.steps - 1)
    tracker.close()
    plot(rows, os.path.join(out, "curves.png"), baseline)
    adapters.save_adapter(model, os.path.join(out, "adapter"), base_model_name_or_path=args.model)
    summary = {"baseline_accuracy": baseline, "final_accuracy": final, "improvement": final - baseline,
               "baseline_accuracy_strict": strict.get(0), "final_accuracy_strict": strict.get(args.steps),
               "reward": args.reward, "prompt": args.prompt,
               "steps": args.steps, "wall_time_s": wall.update(), "wall_time_parts_s": wall.parts,
               "model": args.model, "quant": args.quant,
               "algo": args.algo, "data": args.data, "eval_data": args.eval_data, "eval_items": len(eval_items),
               "eval_temperature": args.eval_temperature, "device": str(device), "out": out}
    hub.write_json(os.path.join(out, "summary.json"), summary)
    print(f"held-out accuracy: {baseline:.3f} -> {final:.3f} ({100 * (final - baseline):+.1f} points) "
          f"in {summary['wall_time_s']:.0f} s")
    print(f"wrote {out}/metrics.jsonl, summary.json, samples.jsonl, curves.png, adapter/")
    ddp.shutdown(world)
    return summary


def peak_rss_gb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def format_line(m):
    f = lambda k, fmt: (fmt % m[k]) if m.get(k) is not None else "-"
    return (f"step {m['step']:4d} | reward {f('reward', '%.3f')} acc {f('accuracy', '%.3f')} "
            f"(correct {f('reward_correct', '%.2f')} fmt {f('reward_format', '%.2f')} over {f('reward_overlong', '%.2f')}) "
            f"| ent {f('entropy', '%.3f')} len {f('response_length', '%.1f')} | clip {f('clip_frac_low', '%.3f')}/"
            f"{f('clip_frac_high', '%.3f')} kl {f('kl_ref', '%.4f')} | sampler-trainer kl {f('mismatch_kl', '%.1e')} "
            f"max {f('mismatch_ratio_max', '%.2f')} | filtered {m['filtered_groups']} | sigma {m['sigma']:.1e} "
            f"| t {m['time_rollout']:.1f}+{m['time_update']:.1f}s {m['rollout_tokens_per_s']:.0f} tok/s "
            f"| mem {m['peak_memory_gb']:.2f}GB" + (f" | held-out {m['heldout_accuracy']:.3f}" if "heldout_accuracy" in m else ""))


if __name__ == "__main__":
    main()
