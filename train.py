"""train.py: the QeRL loop. RL with DAPO or GRPO on an NVFP4 base model with LoRA and AQN.

    python train.py                                   # the tiny demo: assets/tiny on arith, CPU, minutes
    python train.py --model qwen2.5-7b --algo dapo    # the paper's 7B GSM8K run on one GPU
    python train.py --quant bf16 ...                  # its 16-bit LoRA baseline (no noise)

One step (QeRL, arXiv 2510.11696, Sec. 3), each stage one call in `main`:

    1. sample      G completions of each prompt (rollout.generate), with AQN's noise on the norms
    2. reward      grade each (tasks.reward) + DAPO's soft overlong penalty; every rank learns every group's
    3. filter      DAPO: keep groups whose samples differ in correctness; resample rounds until the step
                   holds --prompts of them (dynamic sampling; GRPO keeps every group)
    4. advantages  (r - group mean) / group std (grpo.group_advantages), over the kept groups
    5. update      the clipped policy-gradient loss over the batch in micro-batches (logprobs.py), backward
                   through the frozen NVFP4 base into LoRA and the trained norms, clip, AdamW
    6. schedules   the lr's warm-up and cosine; AQN's sigma follows the step (aqn.AQNSchedule)
    7. record      the step's line and metrics (logs.py), the held-out accuracy every --eval-every steps
                   (eval.heldout), a checkpoint every --save-every (runs.py)

Where the rest lives: the settings and the named recipes, each value with its source, in recipes.py
(`python recipes.py` prints them); the run folder, its lock, checkpoints and resume in runs.py; metrics,
plots and live logging in logs.py; the trainer's logprobs in logprobs.py; the step's memory and its plan
in memory.py; data-parallel ranks in ddp.py; the algorithms in grpo.py and dapo.py.

Outputs under --out (default runs/<timestamp>-<run id>): metrics.jsonl (a line a step), samples.jsonl,
curves.png, summary.json, adapter/ (PEFT), checkpoint/ every --save-every steps. `--resume DIR` continues
a run exactly; a larger --steps extends it.

`torchrun --nproc_per_node=N train.py ...`: N ranks on one global batch of --prompts prompts. Each samples,
grades and trains on its block of every round; every rank learns every group's rewards, so dynamic
sampling and the advantages are the global batch's, and the summed gradients give the one-process step up
to float rounding (ddp.py derives it; tests/test_ddp.py checks it). Rank 0 alone prints and writes.

On a GPU the step is planned into the GPU's memory before the model loads (memory.plan, printed at start)
and the update's blocks run through torch.compile (--no-compile: eager). Departures from the official code
are in recipes.py; every step logs the sampler-trainer mismatch (grpo.py).
"""
import contextlib
import math
import os
import sys
import time
import uuid
import warnings
from dataclasses import dataclass
from functools import partial

import torch
from tqdm import tqdm

import aqn
import dapo
import ddp
import fp4_gemm
import grpo
import hub
import lora
import logs
import memory
import recipes
import rollout
import runs
import tasks
from adapters import load_policy, save_adapter
from data import PromptEncoder, PromptStream, load_dataset
from eval import default_batch, heldout, positions_of, too_long
from hub import resolve_device, stop_on_bad_input, stop_token_ids
from logprobs import completion_logprobs, micro_batches
from model import read_config


# ---------------------------------------------------------------------------------------------
# 1-2. Sample a round and reward it
# ---------------------------------------------------------------------------------------------

@dataclass
class Group:
    """One prompt's G samples. Every rank knows the rewards and their parts, (G,) each; the rank that sampled
    them also holds their tokens and logprobs (G, T), truncation flags and texts (None elsewhere)."""
    item: dict
    reward: torch.Tensor
    correct: torch.Tensor
    format: torch.Tensor
    overlong: torch.Tensor
    lengths: torch.Tensor
    tokens: torch.Tensor = None
    logprobs: torch.Tensor = None
    truncated: torch.Tensor = None
    texts: list = None


def sample(model, prompts, args, stop_ids, sigma, noise_seed, seed, per_call=None, keep_cache=True, prompt_len=0):
    """Stage 1: args.group_size completions of each prompt at the rollout's temperature and top-p, with AQN's
    noise of std `sigma` on the norms (None: AQN off), drawn from noise_seed, the same for every round of a
    step; in rollout.generate calls of `per_call` prompts (the memory plan's; None: one call), each row with
    the key it has in one call, so the rows are the same; their KV cache as wide as for a prompt of prompt_len
    tokens (the plan's longest), so that every step's calls reuse the engine's state and graphs, whatever
    the step's own longest prompt. → rollout.Rollout."""
    model.eval()
    gen = torch.Generator(model.device if model.device.type == "cuda" else "cpu").manual_seed(noise_seed)
    noisy = aqn.noise(model, sigma, gen) if sigma is not None else contextlib.nullcontext()
    per_call, G = per_call or len(prompts), args.group_size
    with torch.no_grad(), noisy:
        parts = [rollout.generate(model, prompts[i:i + per_call], n=G, max_new_tokens=args.max_new_tokens,
                                  temperature=args.temperature, top_p=args.top_p, stop_ids=stop_ids,
                                  seed=ddp.shift_seed(seed, i * G), kv_cache=recipes.kv_cache(args),
                                  prompt_len=prompt_len)
                 for i in range(0, len(prompts), per_call)]
    if not keep_cache:  # (the plan has no room for the cache beside the update: the next call rebuilds it)
        rollout.release(model)
    return parts[0] if len(parts) == 1 else rollout.concat(parts)


def reward(items, ro, texts, lo, args, world, device):
    """Stage 2: the reward of each completion this rank sampled (rows of items[lo:...]): the task's (its
    correctness and format parts, tasks.reward) plus DAPO's soft overlong penalty (0 where the band is off);
    then every rank learns every group's (ddp.gather_rows). → a Group per item."""
    G, n = args.group_size, len(items)
    per_row = torch.zeros(4, n * G)  # correct, format, overlong, length of each row; this rank's filled
    if ro is not None:
        rows = slice(lo * G, lo * G + len(texts))
        parts = [tasks.reward(items[lo + i // G]["kind"], t, items[lo + i // G]["answer"], args.reward,
                              signed=args.signed_reward, format_weight=args.format_reward,
                              prompt=recipes.prompt_style(args, items[lo + i // G]["kind"]))[1]
                 for i, t in enumerate(texts)]
        per_row[0, rows] = torch.tensor([p["correct"] for p in parts])
        per_row[1, rows] = torch.tensor([p["format"] for p in parts])
        # (a band of 0 is the hard rule: 0 up to max_new_tokens, which a rollout never passes)
        per_row[2, rows] = dapo.overlong_penalty(ro.lengths.cpu(), args.max_new_tokens, args.overlong_buffer,
                                                 dtype=torch.float32)
        per_row[3, rows] = ro.lengths.cpu().float()
    return groups_of(items, ddp.gather_rows(per_row, world, device).view(4, n, G), ro, lo, texts)


def groups_of(items, parts, ro=None, lo=0, texts=None):
    """A Group per item from its reward parts (4, n, G): correctness, format, overlong penalty, length; the
    rollout's rows (items[lo:]'s samples, G a prompt) go to the groups this rank sampled. (Stage 2 builds
    its groups so; tests and engine/bench_step.py give rewards of their own.)"""
    correct, fmt, over, lengths = parts
    groups = [Group(item, correct[g] + fmt[g] + over[g], correct[g], fmt[g], over[g], lengths[g])
              for g, item in enumerate(items)]
    G = parts.shape[2]
    for i in range(0 if ro is None else ro.tokens.shape[0] // G):
        r, g = slice(i * G, (i + 1) * G), groups[lo + i]
        g.tokens, g.logprobs = ro.tokens[r], ro.logprobs[r]
        g.truncated = torch.tensor([f == "length" for f in ro.finish[r]])
        g.texts = texts[r] if texts is not None else None
    return groups


# ---------------------------------------------------------------------------------------------
# 4-5. Advantages and the update
# ---------------------------------------------------------------------------------------------

@dataclass
class Batch:
    """This rank's rows of the step's kept groups, flattened (row g * G + j), for the update."""
    prompts: list  # B prompt token lists (a group's prompt once for each of its samples)
    completions: torch.Tensor  # (B, T) right-padded
    lengths: torch.Tensor  # (B,)
    sampler_logp: torch.Tensor  # (B, T) the rollout's logprobs
    mask: torch.Tensor  # (B, T) float: completion tokens; a truncated row's zeroed under --mask-truncated
    advantages: torch.Tensor  # (B,)


def training_batch(groups, advantages, encode, mask_truncated, device):
    """Stage 4's output laid out for the update: the groups this rank sampled, with their advantages
    (groups, G). Truncated completions still count in their group's advantages (computed before), and leave
    the loss under --mask-truncated: TRL's mask_truncated_completions, an option of its GRPO trainer that
    the official scripts turn on (and DAPO's overlong filtering)."""
    mine = [i for i, g in enumerate(groups) if g.tokens is not None]
    if not mine:
        return None
    lens = torch.cat([groups[i].lengths for i in mine]).long().cpu()  # (B,)
    T = int(lens.max())
    pad = lambda t: torch.nn.functional.pad(t[:, :T], (0, max(0, T - t.shape[1])))
    completions = torch.cat([pad(groups[i].tokens) for i in mine]).cpu()  # (B, T)
    old = torch.cat([pad(groups[i].logprobs) for i in mine]).to(device)  # (B, T)
    mask = (torch.arange(T)[None] < lens[:, None]).float()  # (B, T)
    if mask_truncated:
        mask = dapo.apply_overlong_filter(mask, torch.cat([groups[i].truncated for i in mine]))
    prompts = [encode(groups[i].item) for i in mine for _ in range(len(groups[i].lengths))]
    return Batch(prompts, completions, lens, old, mask.to(device), advantages[mine].flatten().to(device))


@dataclass
class UpdateConfig:
    """What the update uses (recipes.py gives each value's source). `update_config(args)` builds it from
    train.py's settings; tests and engine/bench_step.py build it directly."""
    max_new_tokens: int
    # The trainer's logprobs are of softmax(logits / temperature): --train-temperature, by default the rollout's
    # (as TRL's GRPO trainer). The sampler's logprobs stay at the rollout's, so under another temperature the
    # logged sampler-trainer mismatch (and --ratio sampler|tis) measures the temperatures' gap too.
    temperature: float = 1.0
    passes: int = 1
    micro_batch: int = 8
    logp_chunk: int = 1024
    checkpointing: str = "auto"
    eps_low: float = 0.2
    eps_high: float = 0.28
    beta: float = 0.0
    loss_agg: str = "token-mean"
    ratio: str = "trainer"
    tis_cap: float = 2.0
    grad_clip: float = 0.2
    fp8: bool = False


def update_config(args, plan=None):
    """The update's settings from train.py's, with the memory plan's micro-batch and logprob chunk (a GPU's)."""
    return UpdateConfig(args.max_new_tokens, args.train_temperature, args.update_passes,
                        plan.micro_batch if plan else args.micro_batch, plan.logp_chunk if plan else args.logp_chunk,
                        args.checkpointing, args.eps_low, args.eps_high, args.beta, args.loss_agg, args.ratio,
                        args.tis_cap, args.grad_clip, args.fp8_update)


def update(cfg, model, optimizer, params, batch, world=ddp.World(), noise=None):
    """Stage 5: cfg.passes passes of the clipped policy-gradient loss over the batch, in micro-batches whose
    losses add up to the whole batch's (grpo.policy_loss with the global batch's counts as divisors). Under
    several ranks the gradients are summed before the clip: one process's update over the global batch
    (ddp.py). noise: (sigma, seed) to apply AQN in the update too (--aqn-update), else None. → metrics."""
    device, unpadded = model.device, model.unpadded_attention
    slices, local = [], (0, 0)
    if batch is not None:
        local = grpo.batch_counts(batch.mask)
        slices = micro_batches(model.config, model.dtype, batch.prompts, batch.lengths, cfg.micro_batch,
                               cfg.max_new_tokens, unpadded)
    num_seqs, num_tokens = ddp.counts(*local, world, device)
    need = max([memory.micro_batch_bytes(model.config, model.dtype, batch.prompts[sl], batch.lengths[sl], unpadded)
                for sl in slices], default=0)
    model.gradient_checkpointing = memory.checkpointing_on(cfg.checkpointing, model.device, need)
    model.train()
    out, first = {}, {}  # first: each micro-batch's trainer logp in the first pass (the policy before the update)
    for p in range(cfg.passes):
        optimizer.zero_grad(set_to_none=True)
        sums = {}
        noisy = aqn.noise(model, noise[0], torch.Generator(device).manual_seed(noise[1])) if noise else \
            contextlib.nullcontext()
        # (dequant_plan: no base product compiles a kernel for a micro-batch's new token count in a later step)
        with noisy, fp4_gemm.fp8_tensor_cores(cfg.fp8), fp4_gemm.dequant_plan():
            for i, sl in enumerate(slices):
                prompts, completions, lengths = batch.prompts[sl], batch.completions[sl], batch.lengths[sl]
                ref = None
                if cfg.beta > 0:  # the reference policy is the base model: the same weights, adapters off. (First:
                    # disable_adapters swaps trained norms in place, which a pending backward would refuse.)
                    with torch.no_grad(), lora.disable_adapters(model):
                        ref, _ = completion_logprobs(model, prompts, completions, lengths, cfg.temperature, cfg.logp_chunk)
                logp, ent = completion_logprobs(model, prompts, completions, lengths, cfg.temperature, cfg.logp_chunk)
                if p == 0 and cfg.passes > 1:
                    first[i] = logp.detach()
                # old: the sampler's logprobs (--ratio sampler) or the trainer's own before this update (trainer,
                # tis); is_weight: tis's truncated pi_trainer / pi_sampler (grpo.sampler_correction)
                old, is_weight = grpo.sampler_correction(cfg.ratio, logp, batch.sampler_logp[sl], cfg.tis_cap,
                                                         first.get(i) if p else None)
                loss, lm = grpo.policy_loss(logp, old, batch.advantages[sl], batch.mask[sl], eps_low=cfg.eps_low,
                                            eps_high=cfg.eps_high, ref_logp=ref, beta=cfg.beta, agg=cfg.loss_agg,
                                            num_seqs=num_seqs, num_tokens=num_tokens, const=cfg.max_new_tokens,
                                            entropy=ent, is_weight=is_weight, sampler_logp=batch.sampler_logp[sl],
                                            tis_cap=cfg.tis_cap)
                loss.backward()
                grpo.add_metrics(sums, lm, num_tokens)
        ddp.all_reduce_grads(params, world)  # (the sum over the ranks: the global loss's gradient, on every rank)
        sums = ddp.reduce_metrics(sums, world)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        if not torch.isfinite(grad_norm):
            tqdm.write(f"non-finite loss or gradient (grad norm {grad_norm}); skipping this update")
            optimizer.zero_grad(set_to_none=True)
            out["skipped"] = True
        else:
            optimizer.step()
        out.update(sums, grad_norm=float(grad_norm))
    out["checkpointing"], out["micro_batches"] = int(model.gradient_checkpointing), len(slices)
    return out


def compile_backend(device, no_compile):
    """The torch.compile backend for the update's blocks (model.compile_blocks): inductor on a GPU unless
    --no-compile, which fuses the elementwise work between the GEMMs; none on the CPU, where the tiny run and
    the tests stay eager. The rollout never runs compiled blocks."""
    return "inductor" if device.type == "cuda" and not no_compile else None


# ---------------------------------------------------------------------------------------------
# 6. Schedules
# ---------------------------------------------------------------------------------------------

def lr_lambda(warmup_steps, schedule_steps, min_lr_ratio):
    """The lr factor at a step: linear warm-up, then cosine to min_lr_ratio over the run's first --steps
    (steps that --resume adds stay at the floor)."""
    def f(step):
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        t = (step - warmup_steps) / max(1, schedule_steps - warmup_steps)
        return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))
    return f


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------

def plan_step(args, model_dir, data, cap, world):
    """Before the model loads: the longest prompts and their completion budgets against the model's positions;
    on a GPU (cap: its bytes; None on the CPU) the step and the held-out evaluation planned (memory.plan,
    printed), or the setting to lower named. → memory.Plan or None."""
    cfg = read_config(model_dir)[2]
    encode = PromptEncoder(hub.load_tokenizer(model_dir), partial(recipes.prompt_style, args))
    longest = [max(len(encode(it)) for it in sorted(items, key=lambda it: len(it["question"]))[-256:])
               for items in data]  # (the longest in tokens is among the 256 longest in characters)
    for flag, n, budget in (("--max-new-tokens", longest[0], args.max_new_tokens),
                            ("--eval-max-new-tokens", longest[1], args.eval_max_new_tokens)):
        if why := too_long(n, budget, positions_of(cfg)):
            raise ValueError(why.replace("max_new_tokens", flag, 1))
    if cap is None:
        return None
    plan = memory.plan(cfg, cap, prompts=-(-args.prompts // world.size), group_size=args.group_size,
                       prompt_len=longest[0], max_new_tokens=args.max_new_tokens, micro_batch=args.micro_batch,
                       lora_rank=args.lora_rank, logp_chunk=args.logp_chunk, quant=args.quant,
                       lora_targets=recipes.lora_targets(args), train_norms=args.train_norms, checkpointing=args.checkpointing,
                       title=f"{args.model}, {args.quant}", eval_samples=args.eval_samples, eval_prompt_len=longest[1],
                       eval_max_new_tokens=args.eval_max_new_tokens, eval_rows=default_batch("cuda"),
                       kv_cache=recipes.kv_cache(args))
    print(plan.describe())
    if not plan.fits:
        raise ValueError(f"the step does not fit in {cap / 1e9:.1f} GB of GPU memory: " + "; ".join(plan.problems))
    return plan


def main(argv=None):
    """The settings, the ranks, and everything the user named (model, data, checkpoint, output folder), each
    checked before minutes of loading; then the run, with the folder locked until it ends."""
    args = recipes.parse(argv)
    if not args.resume:
        args.run_id = uuid.uuid4().hex  # checkpoints carry it: a run resumes only from its own
    if getattr(args, "schedule_steps", None) is None:  # the lr and AQN schedules' length: --steps at the start
        args.schedule_steps = args.steps
    device = resolve_device(args.device, "train.py")
    if args.fp8_update and not fp4_gemm.fp8_supported(device):
        sys.exit("train.py: --fp8-update needs FP8 tensor cores (an Ada, Hopper or Blackwell GPU) or a CPU torch "
                 "whose _scaled_mm takes one scale a row; drop --fp8-update")
    # Under torchrun: this rank's place and device (ddp.py); rank 0 names the run for all and alone writes.
    world, device = ddp.init(device)
    if world.size > 1:
        args.run_id = getattr(args, "run_id", None) if args.resume else ddp.broadcast(args.run_id, world)
        if not world.main:
            sys.stdout = open(os.devnull, "w")  # (stderr stays: errors and warnings of every rank show)
    out = args.resume or ddp.broadcast(args.out or runs.default_out(args.run_id), world)
    with stop_on_bad_input("train.py"):
        model_dir = read_config(args.model)[0]
        data = load_dataset(args.data, split="train"), load_dataset(args.eval_data, split="test", limit=args.eval_limit)
        for name, items in zip((args.data, args.eval_data), data):
            if not items:
                raise ValueError(f"{name} holds no problems")
        checkpoint = runs.resume_point(out, getattr(args, "run_id", None), args.steps, args.data) \
            if args.resume else None
        plan = plan_step(args, model_dir, data, memory.gpu_budget(device, args.mem_cap_gb)
                         if device.type == "cuda" else None, world)
        lock = runs.open_run(out, getattr(args, "run_id", None), args.resume, [model_dir, args.data, args.eval_data],
                             args.force) if world.main else None
    try:
        return run(args, model_dir, data, checkpoint, out, world, device, plan)
    finally:
        if lock is not None:
            lock.release()


def run(args, model_dir, data, checkpoint, out, world, device, plan=None):
    """Load the policy, then the loop of stages (their memory laid out by `plan`, on a GPU); → the summary
    (rank 0) or None."""
    torch.manual_seed(args.seed)
    with stop_on_bad_input("train.py"):  # (a damaged weight file names itself)
        model, tokenizer = load_policy(model_dir, quant=args.quant, device=device)  # (bf16 on a GPU, fp32 on CPU)
    params = lora.apply_lora(model, rank=args.lora_rank, alpha=args.lora_alpha, dropout=args.lora_dropout,
                             targets=recipes.lora_targets(args))
    norms = lora.train_norms(model) if args.train_norms else []  # (float32, updated in place: the rollout reads them)
    model.compile_blocks = compile_backend(device, args.no_compile)
    # Weight decay on LoRA only: decaying a norm weight pulls it towards 0, not towards its base value (the
    # HF Trainer of the official code exempts every norm weight by name).
    optimizer = torch.optim.AdamW([{"params": params}, {"params": norms, "weight_decay": 0.0}], lr=args.lr,
                                  weight_decay=args.weight_decay, betas=(0.9, args.adam_beta2))
    params = params + norms  # (the gradient-norm clip covers both, as the official Trainer's does)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args.warmup_steps, args.schedule_steps,
                                                                       args.min_lr_ratio))
    schedule = aqn.AQNSchedule(args.schedule_steps, args.aqn_stages, args.sigma_start, args.sigma_end)
    encode, stops = PromptEncoder(tokenizer, partial(recipes.prompt_style, args)), stop_token_ids(tokenizer)
    train_items, eval_items = data
    ucfg, data_sha = update_config(args, plan), runs.data_hash(args.data)  # (the hash: args.json, checkpoints)

    def evaluate():  # (on a GPU in calls of the plan's size, their cache released after: the plan counts no other)
        acc = heldout(model, tokenizer, eval_items, seed=args.seed + 1_000_003, samples=args.eval_samples,
                      temperature=args.eval_temperature, top_p=args.eval_top_p, max_new_tokens=args.eval_max_new_tokens,
                      world=world, prompt=recipes.prompt_style(args, eval_items[0]["kind"]),
                      batch_size=plan and plan.eval_rows)
        if plan:
            rollout.release(model)
        return acc

    step, stream, baseline, rows = 0, PromptStream(train_items, args.seed), None, []
    metrics_path, samples_path = os.path.join(out, "metrics.jsonl"), os.path.join(out, "samples.jsonl")
    if checkpoint:
        with stop_on_bad_input("train.py"):
            step, stream.pos, baseline, rows = runs.restore(checkpoint, model, optimizer, scheduler, out, args,
                                                            world.main)
    elif world.main:
        for p in (metrics_path, samples_path):
            open(p, "w").close()
    if world.main:
        hub.write_json(os.path.join(out, "args.json"), {**{k: v for k, v in vars(args).items() if k not in
                                                             ("changed", "force")}, "data_sha256": data_sha})
    wall = runs.WallTime(out, args.resume) if world.main else None
    tracker = logs.Tracker(args.log if world.main else None, out, getattr(args, "run_id", None), vars(args))
    ddp.same_everywhere(params, world)  # (the same seed and checkpoint: the same parameters on every rank)
    logs.header(args, model, len(norms), sum(p.numel() for p in params), (len(train_items), len(eval_items)), world,
             device, out)
    if baseline is None:
        baseline = evaluate()
        print(f"held-out accuracy before training: {baseline[0]:.3f}")

    bar = tqdm(total=args.steps, initial=step, desc="RL", unit="step", dynamic_ncols=True, disable=not world.main)
    skipped = []  # the steps in a row whose update a non-finite loss or gradient skipped
    # the plan's rollout (on a GPU): prompts a call, the cache kept through the update or not, the cache's width
    layout = (plan.rollout_rows // args.group_size, plan.keep_cache, plan.prompt_len) if plan else ()
    while step < args.steps:
        t0 = time.time()
        sigma = schedule.sigma(step) if args.aqn else 0.0
        kept, rounds, filtered, sampled_tokens = [], 0, 0, 0
        while len(kept) < args.prompts and rounds < args.max_sampling_rounds:  # DAPO's rounds (GRPO: one)
            items = stream.take(args.prompts)
            lo, hi = ddp.shard(len(items), world)  # (this rank's block; its rows keep their one-process keys)
            seed = ddp.shift_seed(args.seed * 7919 + step * 31 + rounds, lo * args.group_size)
            ro = sample(model, [encode(it) for it in items[lo:hi]], args, stops, sigma if args.aqn else None,
                        args.seed * 1_000_003 + step, seed, *layout) if hi > lo else None                # 1. sample
            groups = reward(items, ro, ro.texts(tokenizer) if ro else [], lo, args, world, device)    # 2. reward
            sampled_tokens += int(sum(g.lengths.sum() for g in groups))
            keep = dapo.informative_groups(torch.stack([g.correct for g in groups])) if args.dynamic_sampling \
                else torch.ones(len(groups), dtype=torch.bool)
            kept += [g for g, k in zip(groups, keep) if k]                                              # 3. filter
            filtered, rounds = filtered + int((~keep).sum()), rounds + 1
        kept = kept[:args.prompts]
        if len(kept) < args.prompts:
            tqdm.write(f"step {step}: dynamic sampling fell short: {len(kept)}/{args.prompts} informative groups after "
                       f"{rounds} rounds; training on those")
        t_rollout = time.time() - t0
        m = logs.step_metrics(step, sigma, schedule.stage(step) if args.aqn else None, rounds, filtered, kept,
                         scheduler.get_last_lr()[0])
        if kept:
            advantages = grpo.group_advantages(torch.stack([g.reward for g in kept]), std=args.adv_std)  # 4. advantages
            batch = training_batch(kept, advantages, encode, args.mask_truncated, device)
            noise = (sigma, args.seed * 1_000_003 + step) if args.aqn_update and sigma > 0 else None
            m.update(update(ucfg, model, optimizer, params, batch, world, noise))                       # 5. update
            skipped = skipped + [step] if m.get("skipped") else []
        with warnings.catch_warnings():  # (a skipped update: torch warns of a scheduler step before the optimizer's)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler\.step\(\)` before")
            scheduler.step()                                                                             # 6. schedules
        step += 1
        runs.check_finite(params, step, skipped, out)
        m.update(time_rollout=t_rollout, time_update=time.time() - t0 - t_rollout, time_step=time.time() - t0,
                 rollout_tokens_per_s=sampled_tokens / max(t_rollout, 1e-9), peak_memory_gb=logs.peak_memory_gb(device))
        if args.eval_every and step % args.eval_every == 0 and step < args.steps:                       # 7. record
            m["heldout_accuracy"], m["heldout_accuracy_strict"] = evaluate()
        ddp.same_everywhere(params, world)
        # The first completions of the groups logged to samples.jsonl, from the ranks that sampled them.
        texts = ddp.union({i: g.texts[0] for i, g in enumerate(kept[:args.log_samples]) if g.texts}, world)
        bar.update(1)
        if not world.main:
            continue
        rows.append(m)
        logs.append_jsonl(metrics_path, [m])
        logs.append_jsonl(samples_path, [{"step": m["step"], "question": g.item["question"], "gold": g.item["answer"],
                                          "completion": texts[i], "correct": float(g.correct[0])}
                                         for i, g in enumerate(kept[:args.log_samples])])
        tqdm.write(logs.line(m))
        tracker.log(m, step - 1)
        wall.update()
        if step % args.plot_every == 0:
            logs.plot(rows, os.path.join(out, "curves.png"), baseline[0])
        if (args.save_every and step % args.save_every == 0) or step == args.steps:
            with stop_on_bad_input("train.py"):
                runs.save_checkpoint(out, model, optimizer, scheduler, {
                    "step": step, "data_pos": stream.pos, "baseline_accuracy": baseline[0],
                    "baseline_accuracy_strict": baseline[1], "aqn_stage": schedule.stage(step),
                    "run_id": getattr(args, "run_id", None), "data_sha256": data_sha})
    bar.close()

    final = evaluate()
    if not world.main:
        ddp.shutdown(world)
        return None
    rows[-1]["heldout_accuracy"], rows[-1]["heldout_accuracy_strict"] = final
    tracker.log({"heldout_accuracy": final[0]}, args.steps - 1)
    tracker.close()
    logs.plot(rows, os.path.join(out, "curves.png"), baseline[0])
    with stop_on_bad_input("train.py"):
        save_adapter(model, os.path.join(out, "adapter"), base_model_name_or_path=args.model)
        summary = {"baseline_accuracy": baseline[0], "final_accuracy": final[0], "improvement": final[0] - baseline[0],
                   "baseline_accuracy_strict": baseline[1], "final_accuracy_strict": final[1],
                   **{k: getattr(args, k) for k in ("recipe", "reward", "aqn", "steps", "model", "quant", "algo", "data",
                                                    "eval_data", "eval_temperature")},
                   "prompt": recipes.prompt_style(args, eval_items[0]["kind"]), "eval_items": len(eval_items),
                   "wall_time_s": wall.update(), "wall_time_parts_s": wall.parts, "device": str(device), "out": out}
        runs.write_summary(out, summary)
    print(f"held-out accuracy: {baseline[0]:.3f} -> {final[0]:.3f} ({100 * (final[0] - baseline[0]):+.1f} points) "
          f"in {summary['wall_time_s']:.0f} s")
    print(f"wrote {out}/metrics.jsonl, summary.json, samples.jsonl, curves.png, adapter/")
    ddp.shutdown(world)
    return summary


if __name__ == "__main__":
    main()
