"""train.py: the QeRL loop — RL with GRPO or DAPO on an NVFP4 base model with LoRA and AQN.

One step (QeRL, arXiv 2510.11696, Sec. 3; the algorithms in grpo.py and dapo.py):

    prompts ─► rollout.generate (NVFP4 base + LoRA, AQN noise on the norms) ─► completions + logprobs
            ─► tasks.reward (+ DAPO's soft overlong penalty) ─► rewards (num_groups, G)
            ─► dapo.collect_informative: resample until enough groups have mixed rewards (DAPO only)
            ─► grpo.group_advantages ─► one or more update passes in micro-batches:
               logp of the completion tokens (a micro-batch as one packed row, each prompt once
               for its samples; hidden states through lm_head in chunks, so the (B, T, vocab)
               float32 logits never exist at once), the clipped loss against the
               behaviour policy's logprobs from the rollout, backward through the frozen NVFP4 base
               into the LoRA parameters ─► grad-norm clip ─► AdamW ─► warm-up + cosine schedule

On a GPU the update runs each decoder block through torch.compile (model.compile_blocks; off with
--no-compile), which fuses the elementwise work between the GEMMs: a 7B micro-batch of 8 x 1280
tokens took 907 instead of 1086 ms on the H200 (results/bench_h200.md). The first update compiles
(16-45 s at 7B on the H200), once for every micro-batch shape, as Transformer.hidden marks the token
and sequence counts dynamic (a 1.5B shape measured one compile where torch's default made three); the
rollout never runs compiled blocks. A micro-batch holds --micro-batch sequences where completions run to
the limit, and more in the same memory where they stop early (micro_batches): a 7B update of 64
completions of ~200 tokens took 1.37 instead of 1.95 s on NVFP4, 1.30 instead of 1.38 on bf16 (session 25).
The update recomputes each block's activations in backward (activation checkpointing) only where the
largest micro-batch's would not fit in the GPU's free memory (checkpointing_on): on the H200 that took a
fifth off a 7B or 14B RL step. Running each
prompt once for its samples, and no padding (model.shared_prompt_hidden), took the 7B update on the
H200 from 5.1 to 4.4 s (timed in a first form of it, results/bench_h200.md) and the default tiny run's
from 2.0 to 1.1 s a step.

`python train.py` with no arguments runs the bundled tiny policy (assets/tiny, trained by tiny.py)
on the synthetic arithmetic task, on the CPU (also where there is a GPU: the run and its numbers are
the README's there too; `--device cuda` moves it), in a few minutes. `python train.py --model qwen2.5-7b
--algo dapo` is the paper's recipe on one GPU. Defaults that depend on the model (`None` below) are
filled by `recipe()`; every value comes from a source named there.

Outputs, all under --out (default runs/<timestamp>): metrics.jsonl (one JSON line a step),
samples.jsonl (a few completions a step), curves.png (refreshed as it runs), summary.json
(baseline_accuracy, final_accuracy, wall time), adapter/ (PEFT format), checkpoint/ (adapter,
optimizer, scheduler, step, data position and RNG, written atomically every --save-every steps;
`--resume DIR` continues from it exactly).

Departures from the official QeRL code: the behaviour policy's logprobs come from our own rollout
(the official code recomputes them with a second forward pass of the training model, which does
not see the rollout's AQN noise); AQN noise really reaches the rollout model (tests/test_aqn.py);
held-out evaluation applies the trained adapter (tests/test_eval.py).
"""
import argparse
import json
import math
import os
import random
import shutil
import signal
import sys
import time
import warnings

import numpy as np
import torch
from tqdm import tqdm

import aqn
import dapo
import grpo
import lora
import rollout
import tasks
from eval import evaluate, load_policy
from model import read_config, resolve_device, stop_on_bad_input, stop_token_ids


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, except None: those defaults depend on the model or --algo, and the
    option's help says how."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="RL (DAPO/GRPO) on an NVFP4 base with LoRA and AQN.",
                                formatter_class=_HelpFormatter)
    # what to train
    p.add_argument("--model", default="tiny", help="alias (tiny, qwen2.5-7b, ...), HF folder, NVFP4 folder or hub id")
    p.add_argument("--quant", default="nvfp4", choices=["nvfp4", "bf16"], help="base weights: NVFP4 (QeRL) or 16-bit (the LoRA baseline)")
    p.add_argument("--algo", default="dapo", choices=["dapo", "grpo"], help="policy-gradient algorithm")
    p.add_argument("--data", default=None, help="training set: arith, gsm8k, math500, or a .jsonl path (default: arith for tiny, gsm8k otherwise)")
    p.add_argument("--eval-data", default=None, help="held-out set (default: the test split of --data)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cpu for tiny, else cuda when available)")
    p.add_argument("--seed", type=int, default=0, help="seeds data order, sampling, AQN noise and LoRA init")
    # the loop
    p.add_argument("--steps", type=int, default=None, help="RL steps (tiny: 30; paper recipe: 500)")
    p.add_argument("--prompts", type=int, default=None, help="prompts (groups) per step (tiny: 16; QeRL scripts: 16 with DAPO)")
    p.add_argument("--group-size", type=int, default=8, help="G, completions per prompt (QeRL: 8)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="completion budget (tiny: 64; GSM8K recipe: 1024)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (QeRL: 1.0)")
    p.add_argument("--top-p", type=float, default=1.0, help="rollout nucleus sampling")
    p.add_argument("--update-passes", type=int, default=1, help="passes over each step's batch (1 = on-policy)")
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per forward/backward, at full length "
                   "(tiny: 128; 7B: 8); completions that stop early pack more into the same memory")
    p.add_argument("--logp-chunk", type=int, default=1024, help="completion tokens per lm_head chunk when computing logprobs")
    p.add_argument("--checkpointing", default="auto", choices=["auto", "on", "off"],
                   help="activation checkpointing in the update (auto: off on a GPU where a micro-batch fits without)")
    p.add_argument("--no-compile", action="store_true", help="run the update's blocks eagerly (default: torch.compile "
                   "on a GPU, which fuses their elementwise work)")
    # optimizer (QeRL scripts: AdamW, lr 1e-5 NVFP4 / 5e-6 bf16, warm-up then cosine, grad clip 1.0)
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (tiny: 2e-3; paper: 1e-5 NVFP4, 5e-6 bf16)")
    p.add_argument("--warmup-steps", type=int, default=None, help="linear warm-up steps (default: 5%% of --steps)")
    p.add_argument("--min-lr-ratio", type=float, default=0.1, help="cosine decays to lr * this")
    p.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay on the LoRA parameters")
    p.add_argument("--grad-clip", type=float, default=1.0, help="max global grad norm")
    # LoRA (QeRL: r 32, alpha 32 on q,k,v,o,gate,up,down)
    p.add_argument("--lora-rank", type=int, default=32, help="LoRA rank r")
    p.add_argument("--lora-alpha", type=float, default=32, help="LoRA alpha (scaling alpha/r)")
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
    p.add_argument("--overlong-buffer", type=int, default=None, help="DAPO soft overlong punishment band (default: max_new_tokens//5 with dapo, 0 = off with grpo)")
    p.add_argument("--overlong-filter", action="store_true", help="mask truncated completions out of the loss")
    p.add_argument("--signed-reward", action="store_true", help="correctness +1/-1 instead of 1/0")
    p.add_argument("--format-reward", type=float, default=0.0, help="weight of the format part of the reward")
    # AQN (QeRL: 10 stages, sigma 1e-2 -> 5e-4 in the paper, 1e-4 in the scripts; stage 0 noise-free)
    p.add_argument("--no-aqn", action="store_true", help="disable Adaptive Quantization Noise")
    p.add_argument("--aqn-stages", type=int, default=10, help="number of noise stages over the run")
    p.add_argument("--sigma-start", type=float, default=1e-2, help="AQN sigma at stage 1")
    p.add_argument("--sigma-end", type=float, default=5e-4, help="AQN sigma at the last stage")
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
    p.add_argument("--out", default=None, help="output folder (default runs/<timestamp>)")
    p.add_argument("--resume", default=None, help="a previous --out folder to continue from its checkpoint")
    return p.parse_args(argv)


def recipe(args):
    """Fill the model-dependent defaults: the tiny CPU demo, or the paper's GPU recipe."""
    tiny = args.model == "tiny"
    fill = {
        "data": "arith" if tiny else "gsm8k",
        # A GPU would run the tiny model in bf16 (on the CPU: fp32), a different run from the one the
        # README and the tests measured: on the H200 its first 10 steps learned less (session 19).
        "device": "cpu" if tiny else None,
        "steps": 30 if tiny else 500,
        "prompts": 16,
        "max_new_tokens": 64 if tiny else 1024,
        "micro_batch": 128 if tiny else 8,
        # The tiny model learns from scratch-level signal in minutes only with a large LoRA lr;
        # the paper's values are for 7B+ models (QeRL: 1e-5 NVFP4, 5e-6 bf16).
        "lr": 2e-3 if tiny else (1e-5 if args.quant == "nvfp4" else 5e-6),
        "eval_limit": 256 if tiny else 500,
        "eval_temperature": 1.0 if tiny else 0.6,
        "eval_top_p": 1.0 if tiny else 0.95,
        "eval_every": 10 if tiny else 50,
        "eps_high": 0.28 if args.algo == "dapo" else 0.2,
        "beta": 0.0 if args.algo == "dapo" else 0.04,
        "loss_agg": "token-mean" if args.algo == "dapo" else "seq-mean-token-mean",
    }
    for k, v in fill.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.eval_data is None:
        args.eval_data = args.data
    if args.eval_max_new_tokens is None:
        args.eval_max_new_tokens = args.max_new_tokens
    if args.warmup_steps is None:
        args.warmup_steps = max(1, args.steps // 20)
    if args.overlong_buffer is None:
        args.overlong_buffer = args.max_new_tokens // 5 if args.algo == "dapo" else 0
    return args


def check_args(args):
    """Bad input fails here, before any model is loaded."""
    problems = []
    if args.group_size < 2:
        problems.append(f"--group-size {args.group_size}: group-relative advantages need G >= 2")
    if args.prompts < 1 or args.steps < 1:
        problems.append("--prompts and --steps must be >= 1")
    if args.micro_batch < 1:
        problems.append("--micro-batch must be >= 1")
    if not 0 <= args.overlong_buffer <= args.max_new_tokens:
        problems.append(f"--overlong-buffer {args.overlong_buffer} must be within [0, --max-new-tokens]")
    if args.temperature <= 0:
        problems.append("--temperature must be > 0 for RL (the policy's logprobs use it)")
    for name in (args.data, args.eval_data):
        if name.endswith(".jsonl") and not os.path.exists(name):
            problems.append(f"no data file at {name}")
    if args.resume and find_checkpoint(args.resume) is None:
        problems.append(f"--resume {args.resume}: no checkpoint/ folder in it (killed before its first checkpoint? start it again without --resume)")
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
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(out, model, optimizer, scheduler, state):
    """Write out/checkpoint atomically: build it in checkpoint.tmp, then swap it in by renames.
    Signals that would kill the process are held off during the swap."""
    tmp, final, old = (os.path.join(out, n) for n in ("checkpoint.tmp", "checkpoint", "checkpoint.old"))
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    lora.save_adapter(model, os.path.join(tmp, "adapter"))
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": rng_state(), **state},
               os.path.join(tmp, "state.pt"))
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        if os.path.exists(final):
            os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def find_checkpoint(out):
    """The complete checkpoint folder to resume from, or None: checkpoint/, else checkpoint.old/ (which
    is all there is after a crash between save_checkpoint's two renames)."""
    for name in ("checkpoint", "checkpoint.old"):
        path = os.path.join(out, name)
        if os.path.exists(os.path.join(path, "state.pt")):
            return path
    return None


def load_checkpoint(out):
    path = find_checkpoint(out)
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint in {out}")
    return path, torch.load(os.path.join(path, "state.pt"), weights_only=False)


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


def update(args, model, optimizer, params, groups, rewards, encode, sigma, noise_seed, gen_device):
    """One or more passes of the clipped policy-gradient loss over the step's batch, in micro-batches
    whose losses add up to the full batch's (grpo.policy_loss with the full batch's counts)."""
    device = model.device
    adv = grpo.group_advantages(rewards, std=args.adv_std).flatten().to(device)  # (B,)
    prompts, completions, lens, old, truncated = training_batch(groups, encode, device)
    mask = (torch.arange(completions.shape[1])[None] < lens[:, None]).float()  # (B, Tc)
    if args.overlong_filter:
        mask = dapo.apply_overlong_filter(mask, truncated)
    mask = mask.to(device)
    num_seqs, num_tokens = grpo.batch_counts(mask)
    slices = micro_batches(model.config, model.dtype, prompts, lens, args.micro_batch, args.max_new_tokens)
    need = max(micro_batch_bytes(model.config, model.dtype, prompts[sl], lens[sl]) for sl in slices)
    model.gradient_checkpointing = checkpointing_on(args, model, need)
    model.train()
    out = {}
    for _ in range(args.update_passes):
        optimizer.zero_grad(set_to_none=True)
        sums = {}
        with aqn.noise(model, sigma if args.aqn_update else 0.0, torch.Generator(gen_device).manual_seed(noise_seed)):
            for sl in slices:
                logp, ent = completion_logprobs(model, prompts[sl], completions[sl], lens[sl], args.temperature, args.logp_chunk)
                ref = None
                if args.beta > 0:  # the reference policy is the base model: the same weights, adapters off
                    with torch.no_grad(), lora.disable_adapters(model):
                        ref, _ = completion_logprobs(model, prompts[sl], completions[sl], lens[sl], args.temperature, args.logp_chunk)
                loss, lm = grpo.policy_loss(logp, old[sl], adv[sl], mask[sl], eps_low=args.eps_low, eps_high=args.eps_high,
                                            ref_logp=ref, beta=args.beta, agg=args.loss_agg, num_seqs=num_seqs,
                                            num_tokens=num_tokens, const=args.max_new_tokens, entropy=ent)
                loss.backward()
                # Loss parts already add up across micro-batches; per-token means are re-weighted by tokens.
                w = lm["tokens"] / max(1, num_tokens)
                for k, v in lm.items():
                    if k not in ("tokens", "seqs"):
                        sums[k] = sums.get(k, 0.0) + (v if k in ("loss", "pg_loss", "kl_loss") else v * w)
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
    which are among these, and the frozen base weights need none. Qwen2.5-7B: 4.4 MB a token, against
    4.3 measured (results/bench_h200.md, session 16). `attended`: tokens that attention alone sees on top
    (model.shared_prompt_attention: a shared prompt again for each further sample, the padding), which
    hold their q, k, v and output there too. A 7B micro-batch of 256 + 8 x 1024 tokens and 1792 on top:
    38.4 GB, where the first form of the packing held about 38 (results/bench_h200.md, session 17)."""
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
    GPU: a 7B update of 64 completions of ~200 tokens, in 3-4 micro-batches instead of 8, took 1.37 instead
    of 1.95 s on NVFP4 and 1.30 instead of 1.38 on bf16; in 8, its kernels added up to 1.0-1.08 s, the rest
    gaps between them (H200, results/bench_h200.md, session 25)."""
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
    torch's idle cache, within any per-process cap). Recomputing is a third of the pass's GEMM work: the
    7B update pass took 7.1 s with it and 5.0 s without (results/bench_h200.md, session 16). On the CPU
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
        t = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
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
    with open(saved) as f:
        return argparse.Namespace(**{**vars(parse_args([])), **json.load(f), "resume": run_dir})


def main(argv=None):
    args = parse_args(argv)
    if args.resume:  # a resumed run is the same run: every setting comes from its args.json
        args = saved_args(args.resume)
    args = recipe(args)
    check_args(args)
    t_start = time.time()
    device = resolve_device(args.device)
    torch.manual_seed(args.seed)
    out = args.resume or args.out or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))

    # The model's folder and the data first: either missing or malformed stops here, with what to do,
    # before minutes of loading (and before the run's folder exists).
    with stop_on_bad_input("train.py"):
        model_dir = read_config(args.model)[0]
        train_items = tasks.load_dataset(args.data, split="train" if not args.data.endswith(".jsonl") else "test")
        eval_items = tasks.load_dataset(args.eval_data, split="test", limit=args.eval_limit)
    if not train_items:
        raise SystemExit(f"train.py: {args.data} holds no problems")
    os.makedirs(out, exist_ok=True)
    kind = train_items[0]["kind"]

    model, tokenizer = load_policy(model_dir, quant=args.quant, device=device)  # (bf16 on a GPU, fp32 on CPU)
    params = lora.apply_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                             targets=tuple(args.lora_targets.split(",")))
    model.compile_blocks = compile_backend(device, args.no_compile)
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=args.weight_decay, betas=(0.9, 0.999))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args))
    schedule = aqn.AQNSchedule(args.steps, args.aqn_stages, args.sigma_start, args.sigma_end)
    stop_ids = stop_token_ids(tokenizer)
    prompt_ids = {}

    def encode(item):
        q = item["question"]
        if q not in prompt_ids:
            prompt_ids[q] = tasks.get_task(kind).prompt_ids(tokenizer, q)
        return prompt_ids[q]

    def heldout(step):
        model.eval()
        res = evaluate(model, tokenizer, eval_items, kind, samples=args.eval_samples, temperature=args.eval_temperature,
                       top_p=args.eval_top_p, max_new_tokens=args.eval_max_new_tokens, seed=args.seed + 1_000_003)
        return res["accuracy"]

    step, stream, baseline, rows = 0, PromptStream(train_items, args.seed), None, []
    metrics_path, samples_path = os.path.join(out, "metrics.jsonl"), os.path.join(out, "samples.jsonl")
    if args.resume:
        ckpt, state = load_checkpoint(out)
        lora.load_adapter(model, os.path.join(ckpt, "adapter"))
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        step, stream.pos, baseline = state["step"], state["data_pos"], state["baseline_accuracy"]
        truncate_jsonl(metrics_path, step)
        truncate_jsonl(samples_path, state["samples_lines"])
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f]
        print(f"resumed {out} at step {step}")
    else:
        for p in (metrics_path, samples_path):
            open(p, "w").close()
    with open(os.path.join(out, "args.json"), "w") as f:
        json.dump(vars(args), f, indent=2)

    n_train = sum(p.numel() for p in params)
    weight_gb = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())) / 1e9
    print(f"model {args.model} ({model.config}) base={args.quant} on {device} ({weight_gb:.3f} GB of weights; "
          f"fp4 matmuls: {'Triton kernels' if device.type == 'cuda' else 'torch dequantize + matmul'}), "
          f"LoRA r={args.lora_rank}: {n_train / 1e6:.2f}M trainable parameters")
    print(f"{args.algo}: {args.steps} steps x {args.prompts} prompts x G={args.group_size} = "
          f"{args.prompts * args.group_size} completions/step, <= {args.max_new_tokens} new tokens each; "
          f"lr {args.lr:g}, eps {args.eps_low}/{args.eps_high}, beta {args.beta}, AQN "
          f"{'off' if args.no_aqn else schedule}; data {args.data} ({len(train_items)} train, {len(eval_items)} held-out)")
    print(f"outputs in {out}")
    if baseline is None:
        baseline = heldout(0)
        print(f"held-out accuracy before training: {baseline:.3f}")

    bar = tqdm(total=args.steps, initial=step, desc="RL", unit="step", dynamic_ncols=True)
    while step < args.steps:
        t0 = time.time()
        sigma = 0.0 if args.no_aqn else schedule.sigma(step)
        noise_seed = args.seed * 1_000_003 + step
        gen_device = device if device.type == "cuda" else "cpu"
        sampled_tokens = []  # every round's, kept or filtered: what the rollout time was spent on

        def sample(round_):
            items = stream.take(args.prompts)
            model.eval()
            with torch.no_grad(), aqn.noise(model, sigma, torch.Generator(gen_device).manual_seed(noise_seed)):
                ro = rollout.generate(model, [encode(it) for it in items], n=args.group_size,
                                      max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_p=args.top_p, stop_ids=stop_ids, seed=args.seed * 7919 + step * 31 + round_)
            sampled_tokens.append(int(ro.lengths.sum()))
            texts = ro.texts(tokenizer)
            parts = [tasks.reward(kind, t, items[i // args.group_size]["answer"], signed=args.signed_reward,
                                  format_weight=args.format_reward)[1] for i, t in enumerate(texts)]
            correct = torch.tensor([p["correct"] for p in parts])
            fmt = torch.tensor([p["format"] for p in parts])
            # (buffer 0: the hard rule, zero up to max_new_tokens, which rollouts never pass)
            over = dapo.overlong_penalty(ro.lengths.cpu(), args.max_new_tokens, args.overlong_buffer, dtype=torch.float32)
            G = args.group_size
            total = (correct + fmt + over).view(len(items), G)  # (groups, G)
            groups = [dict(item=items[g], rollout=ro, rows=list(range(g * G, (g + 1) * G)), reward=total[g],
                           correct=correct.view(-1, G)[g], format=fmt.view(-1, G)[g], overlong=over.view(-1, G)[g],
                           texts=texts[g * G:(g + 1) * G]) for g in range(len(items))]
            # DAPO filters groups by correctness alone: all right or all wrong carries no signal.
            return groups, correct.view(len(items), G)

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

        m = {"step": step, "sigma": sigma, "aqn_stage": schedule.stage(step), "rounds": rounds,
             "filtered_groups": filtered, "groups": len(groups), "lr": scheduler.get_last_lr()[0]}
        if groups:
            correct = torch.stack([g["correct"] for g in groups])
            m.update(reward=rewards.mean().item(), reward_correct=correct.mean().item(),
                     reward_format=torch.stack([g["format"] for g in groups]).mean().item(),
                     reward_overlong=torch.stack([g["overlong"] for g in groups]).mean().item(),
                     accuracy=(correct > 0).float().mean().item())
        update_metrics = update(args, model, optimizer, params, groups, rewards, encode, sigma, noise_seed, gen_device) if groups else {}
        # The schedule counts steps, updated or skipped (no informative groups, a NaN): torch warns when it
        # advances before the optimizer's first step, which here is what is meant.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            scheduler.step()
        step += 1
        t_total = time.time() - t0
        lengths = torch.cat([g["rollout"].lengths[g["rows"]].cpu() for g in groups]).float() if groups else torch.zeros(1)
        m.update(update_metrics, response_length=lengths.mean().item(), response_length_max=lengths.max().item(),
                 time_rollout=t_rollout, time_update=t_total - t_rollout, time_step=t_total,
                 rollout_tokens_per_s=sum(sampled_tokens) / max(t_rollout, 1e-9),
                 peak_memory_gb=(torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else peak_rss_gb()))
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:
            m["heldout_accuracy"] = heldout(step)
        rows.append(m)
        with open(metrics_path, "a") as f:
            f.write(json.dumps(m) + "\n")
        with open(samples_path, "a") as f:
            for g in groups[: args.log_samples]:
                f.write(json.dumps({"step": step - 1, "question": g["item"]["question"], "gold": g["item"]["answer"],
                                    "completion": g["texts"][0], "correct": float(g["correct"][0])}) + "\n")
        tqdm.write(format_line(m))
        bar.update(1)
        if step % args.plot_every == 0:
            plot(rows, os.path.join(out, "curves.png"), baseline)
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            with open(samples_path) as f:
                samples_lines = sum(1 for _ in f)
            save_checkpoint(out, model, optimizer, scheduler, {"step": step, "data_pos": stream.pos,
                                                               "baseline_accuracy": baseline, "samples_lines": samples_lines,
                                                               "aqn_stage": schedule.stage(step)})
    bar.close()

    final = heldout(args.steps)
    rows[-1]["heldout_accuracy"] = final
    plot(rows, os.path.join(out, "curves.png"), baseline)
    lora.save_adapter(model, os.path.join(out, "adapter"), base_model_name_or_path=args.model)
    summary = {"baseline_accuracy": baseline, "final_accuracy": final, "improvement": final - baseline,
               "steps": args.steps, "wall_time_s": time.time() - t_start, "model": args.model, "quant": args.quant,
               "algo": args.algo, "data": args.data, "eval_data": args.eval_data, "eval_items": len(eval_items),
               "eval_temperature": args.eval_temperature, "device": str(device), "out": out}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"held-out accuracy: {baseline:.3f} -> {final:.3f} ({100 * (final - baseline):+.1f} points) "
          f"in {summary['wall_time_s']:.0f} s")
    print(f"wrote {out}/metrics.jsonl, summary.json, samples.jsonl, curves.png, adapter/")
    return summary


def peak_rss_gb():
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def format_line(m):
    f = lambda k, fmt: (fmt % m[k]) if m.get(k) is not None else "-"
    return (f"step {m['step']:4d} | reward {f('reward', '%.3f')} acc {f('accuracy', '%.3f')} "
            f"(correct {f('reward_correct', '%.2f')} fmt {f('reward_format', '%.2f')} over {f('reward_overlong', '%.2f')}) "
            f"| ent {f('entropy', '%.3f')} len {f('response_length', '%.1f')} | clip {f('clip_frac_low', '%.3f')}/"
            f"{f('clip_frac_high', '%.3f')} kl {f('kl_ref', '%.4f')} | filtered {m['filtered_groups']} | sigma {m['sigma']:.1e} "
            f"| t {m['time_rollout']:.1f}+{m['time_update']:.1f}s {m['rollout_tokens_per_s']:.0f} tok/s "
            f"| mem {m['peak_memory_gb']:.2f}GB" + (f" | held-out {m['heldout_accuracy']:.3f}" if "heldout_accuracy" in m else ""))


if __name__ == "__main__":
    main()
