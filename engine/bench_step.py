"""Benchmark of full RL steps on one GPU, 16-bit LoRA against NVFP4 LoRA, side by side in one run.

Speeds up nothing itself: it times what train.py does in a step (rollout.generate, through the engine on
a GPU, then train.update) at real model shapes. Its code path is tested on the CPU with a tiny shape
(tests/engine/test_bench_step.py). The tables it printed: results/bench_h200.md.

QeRL's headline claim (arXiv 2510.11696, Sec. 4.3) is that an RL step on an NVFP4 base is faster
than on a bf16 base (rollout is memory-bound decoding, which reads 3.5x fewer weight bytes) and fits
a 32B model on one 80 GB GPU. This script measures both on Qwen2.5-shaped models with random weights
(no checkpoint is needed, so it runs on a machine without internet):

    one step = rollout (prompts x G completions of exactly --new-tokens tokens: no stop token, so
               every configuration decodes the same amount)
             + a reward stand-in (random 0/1 per completion, so every group carries signal)
             + one update pass of train.update (DAPO loss, chunked logprobs, the blocks through
               torch.compile and activation checkpointing only where the memory plan needs it, AdamW on
               the LoRA parameters)

and prints rollout tokens/s, update tokens/s, the step time split, peak GPU memory
(torch.cuda.max_memory_allocated) and the NVFP4 / bf16 ratios. `--mem-cap-gb 80` caps the process
with torch.cuda.set_per_process_memory_fraction to reproduce an 80 GB card on a larger one.
`--early-stop MEAN` lets the completions stop as real ones do, after ~MEAN tokens on average (a long
tail up to --new-tokens): then the rollout's batch shrinks as its rows finish (engine/decode.py) and the
update sees fewer tokens. Every mode decodes the same lengths (the mean_len column), so that the modes'
times compare the same work: the rollout samples at PAIRED_TEMPERATURE (engine/bench_rollout.py), where
the seeded noise of each draw picks the token whatever the base (its update trains at that temperature
too; mismatch_kl is then not reported, since it measures nothing there: the forced-length run measures it).

    python -m engine.bench_step --size 7b                   # bf16 and NVFP4, 8 prompts x 8, 256 + 1024 tokens
    python -m engine.bench_step --size 7b --early-stop 256  # the same, completions of ~256 tokens on average
    python -m engine.bench_step --size 32b --modes nvfp4 --mem-cap-gb 80
    python -m engine.bench_step --size 72b --modes nvfp4 --mem-cap-gb 80 --decode-batch1  # built in NVFP4
    python -m engine.bench_step --size 7b --modes bf16,nvfp4,nvfp4+fp8   # and the update on FP8 tensor cores
    python -m engine.bench_step --size 7b --modes bf16,nvfp4,nvfp4+fp8kv # and the rollout's KV cache in FP8
    python -m engine.bench_step --size 7b --early-stop 256 --profile       # and where each step's time goes

The last column is the step's sampler-trainer mismatch (grpo.py's mismatch_kl: the rollout's logprobs
against the update's, no AQN here), which --fp8-update and --fp8-kv raise.

Memory. Each mode first plans its step with memory.plan (printed as a table): on a GPU, in what this
process may use (free memory, or --mem-cap-gb); the rollout runs in as many rollout.generate calls of
whole groups as its KV cache needs (each call's rows keyed as in one call: the same samples), the cache
is released before the update where the two do not fit together, and the update takes the plan's
micro-batch, logprob chunk and activation checkpointing. What does not fit is printed, and no model is
built; a mode that runs out of memory anyway is reported with the phase and torch's account of it. The
peak of each phase is measured beside the plan's estimate.

Every row reports the first (warm-up) step's time, which compiles the update's blocks and captures the
rollout's CUDA graphs, beside the steady-state mean of the timed steps. A graph (torch.compile) or a
kernel (Triton) compiled in a timed step is a recompile: a step brought a shape, such as a micro-batch's
token count, that the first step had not compiled for. It is a bug to fix, not a cost to average: the
counts are a line of their own and JSON fields (their seconds stay inside that step's times). The
rollout's decode is set against its floor (weights and KV cache read once a step at the card's copy
bandwidth, measured in the same run), as is the batch-1 decode of --decode-batch1. --json writes the
rows, --md the tables.
"""
import argparse
import faulthandler
import gc
import math
import os
import sys
import time

import torch

import ddp
import grpo
import lora
import memory
import rollout
import train
from engine.bench_gemm import SIZES, write_json
from engine.bench_rollout import (PAIRED_TEMPERATURE, floor_ms, mean_length, random_model, random_stop_ids,
                                  step_bytes)
from hub import write_text
from model import qwen25_config


# the bases: 16-bit, NVFP4, NVFP4 with the update on FP8 tensor cores, NVFP4 with the rollout's KV cache in FP8
MODES = ("bf16", "nvfp4", "nvfp4+fp8", "nvfp4+fp8kv")


def kv_cache_of(mode):
    """What the rollout's KV cache stores in `mode` (rollout.KVCache)."""
    return "fp8" if mode == "nvfp4+fp8kv" else "model"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="RL step benchmark: bf16-LoRA vs NVFP4-LoRA on random Qwen2.5 shapes.")
    p.add_argument("--size", default="7b", choices=SIZES, help="Qwen2.5 shape")
    p.add_argument("--modes", default="bf16,nvfp4", help="comma-separated bases to compare: bf16, nvfp4, nvfp4+fp8 "
                   "(an NVFP4 base whose update runs on FP8 tensor cores: train.py --fp8-update), nvfp4+fp8kv (an "
                   "NVFP4 base whose rollout keeps its KV cache in FP8: train.py --fp8-kv)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step")
    p.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--new-tokens", type=int, default=1024, help="generated tokens per completion (forced)")
    p.add_argument("--early-stop", type=mean_length, default=0, metavar="MEAN",
                   help="instead of forcing --new-tokens, let completions stop after ~MEAN tokens on average (a stop "
                        "list of vocab/MEAN random ids; at most --new-tokens), as real ones do")
    p.add_argument("--steps", type=int, default=2, help="timed RL steps per mode (after one warm-up step)")
    p.add_argument("--lora-rank", type=int, default=32, help="LoRA rank on all seven projections")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per update forward/backward at full length "
                   "(train.py's: more where completions stop early; the memory plan may lower it)")
    p.add_argument("--logp-chunk", type=int, default=1024, help="completion tokens per lm_head chunk in the update "
                   "(train.py's; the memory plan may lower it)")
    p.add_argument("--checkpointing", default="auto", choices=["auto", "on", "off"],
                   help="activation checkpointing in the update (auto: the memory plan's choice, off where a "
                        "micro-batch fits without)")
    p.add_argument("--mem-cap-gb", type=float, default=None, help="cap this process's GPU memory at this many GB "
                   "(1e9 bytes; e.g. 80 for an 80 GB card on a larger one), and plan the step in it")
    p.add_argument("--decode-batch1", action="store_true", help="also time batch-1 rollout tok/s, against its floor")
    p.add_argument("--no-compile", action="store_true", help="update with eager blocks (as train.py --no-compile)")
    p.add_argument("--profile", action="store_true", help="also say where a step's time goes, in one more step after "
                   "the timed ones: its rollout's decode at each batch size, its update under torch.profiler (kernels by "
                   "kind, and the GPU's idle time between them by what it waited for)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write every mode's row (plan, first and steady "
                   "steps, peaks, floors, recompiles) as JSON here, after each mode")
    p.add_argument("--md", default=None, metavar="PATH", help="also write the printed tables (markdown) here")
    a = p.parse_args(argv)
    if any(m not in MODES for m in a.modes.split(",")):
        p.error(f"--modes {a.modes}: each one of {', '.join(MODES)}, separated by commas")
    if a.steps < 1:  # (the warm-up step is not timed: with none timed there is nothing to report)
        p.error(f"--steps {a.steps}: at least 1 timed step")
    small = [f"--{k.replace('_', '-')} {getattr(a, k)}" for k in ("prompts", "prompt_len", "new_tokens", "lora_rank",
                                                                   "micro_batch", "logp_chunk") if getattr(a, k) < 1]
    if a.group_size < 2 or small:
        p.error(", ".join(small + ([f"--group-size {a.group_size}"] if a.group_size < 2 else [])) +
                ": must be at least 1 (the group size at least 2)")
    if a.mem_cap_gb is not None and not a.mem_cap_gb > 0:
        p.error(f"--mem-cap-gb {a.mem_cap_gb}: a number of GB > 0")
    return a


def sampling_temperature(a):
    """The rollout's (and the update's) temperature: 1, or PAIRED_TEMPERATURE with --early-stop."""
    return PAIRED_TEMPERATURE if a.early_stop else 1.0


def stop_ids(a, vocab):
    """The rollout's stop list: none (every completion runs --new-tokens), or with --early-stop MEAN the
    same random ids in every mode, which end a completion after ~MEAN tokens on average
    (engine.bench_rollout.random_stop_ids)."""
    if not a.early_stop:
        return ()
    return random_stop_ids(vocab, a.early_stop, torch.Generator().manual_seed(1))


def step_plan(a, cfg, mode, cap, headroom=None):
    """memory.plan of this benchmark's step for `mode`'s base in `cap` bytes (None: not measured, the CPU):
    LoRA float32 on the seven projections, the norms not trained (this benchmark trains the adapters alone)."""
    return memory.plan(cfg, cap, prompts=a.prompts, group_size=a.group_size, prompt_len=a.prompt_len,
                       max_new_tokens=a.new_tokens, micro_batch=a.micro_batch, lora_rank=a.lora_rank,
                       logp_chunk=a.logp_chunk, quant="bf16" if mode == "bf16" else "nvfp4", train_norms=False,
                       checkpointing=a.checkpointing, headroom=headroom, title=f"Qwen2.5-{a.size} shape, {mode}",
                       kv_cache=kv_cache_of(mode))


def update_config(a, plan, fp8=False):
    """train.update's settings for one on-policy DAPO pass: train.UpdateConfig's defaults (the gsm8k recipe's
    loss), with the plan's micro-batch, logprob chunk and checkpointing (--checkpointing as given where the
    plan measured nothing: the CPU) and this benchmark's completion length. (Truncated completions stay in
    the loss, timed_step's batch: forced-length ones are all truncated, and masking them would leave the
    update nothing to do.)"""
    ckpt = a.checkpointing if plan.cap is None else ("on" if plan.checkpointing else "off")
    return train.UpdateConfig(max_new_tokens=a.new_tokens, micro_batch=plan.micro_batch, logp_chunk=plan.logp_chunk,
                              checkpointing=ckpt, fp8=fp8, temperature=sampling_temperature(a))


# Kinds of update kernels, by name: the first pattern a kernel's name contains (lower case) decides
KINDS = (("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
         ("GEMM (cuBLAS, FP8 or bf16)", ("gemm", "gemv", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "scaled_mm",
                                         "addmm", "aten::mm", "aten::bmm", "splitkreduce")),
         ("NVFP4 weight to bf16 / E4M3", ("_dequant_kernel",)),
         ("FP8 rows", ("_rows_e4m3",)),
         ("fused elementwise (torch.compile)", ("triton_",)),  # (inductor's kernels: triton_poi_fused_..)
         ("optimizer, grad-norm clip", ("adam", "multi_tensor", "foreach")),
         ("copies, casts, fills", ("copy", "memcpy", "memset", "cat", "fill", "to_copy", "index", "gather",
                                   "scatter")),
         ("log-softmax, norms, other elementwise", ("softmax", "norm", "elementwise", "reduce", "vectorized", "silu",
                                                    "mul", "add", "exp", "log")))


def kind_of(name):
    """The KINDS entry a kernel (or, on the CPU, an operator) name falls in."""
    name = name.lower()
    return next((k for k, pats in KINDS if any(q in name for q in pats)), "other")


def profile_update(run, device):
    """Run `run` (one update) under torch.profiler. → (kinds, idle, before, longest):

        kinds    {kind: s}: the device's kernels (CUDA) or the CPU's operators (the CPU, for the tests) by KINDS
        idle     s the GPU sat idle between its kernels
        before   {kind: s}: that idle by the kind of the kernel each gap ended with (what the GPU waited for)
        longest  the three longest gaps as (s, that kind, s into the update): when it waited

    (the last three None on the CPU). The profiler slows the host (it traces every launch), so the wall time
    to set these against is an unprofiled update's: the timed steps'."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        sync(device)
    kinds = {}
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if us <= 0 or (cuda and e.key.startswith(("aten::", "cuda"))):  # (the CPU side of a launch)
            continue
        kind = kind_of(e.key)
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e6
    if not cuda:
        return kinds, None, None, None
    kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type.name == "CUDA"]
    gaps, before = gaps_between(kernels), {}
    for gap, name, _ in gaps:
        kind = kind_of(name)
        before[kind] = before.get(kind, 0.0) + gap
    longest = [(gap, kind_of(name), at) for gap, name, at in sorted(gaps, reverse=True)[:3]]
    return kinds, sum(before.values()), before, longest


def gaps_between(kernels):
    """The GPU's idle stretches between kernels ((start, end, name) in µs, on any streams): (seconds, the name
    of the kernel that ended it, seconds from the first kernel's start to the stretch) for each stretch that no
    kernel covers."""
    out, end, first = [], None, min((a for a, _, _ in kernels), default=0)
    for a, b, name in sorted(kernels):
        if end is not None and a > end:
            out.append(((a - end) / 1e6, name, (end - first) / 1e6))
        end = b if end is None else max(end, b)
    return out


def profile_text(mode, stats, update):
    """Where a step's time went: the rollout's prefill, its decode at each batch size (engine/decode.py's
    segments: rows, steps, seconds) and graph captures; the update's time (the timed steps'), and under the
    profiler its kernels by kind and the GPU's idle time between them, by what it waited for (profile_update)."""
    lines = [f"  {mode}: rollout: prefill {stats['prefill_s'] * 1e3:.0f} ms, captures {stats['capture_s']:.2f} s, decode "
             f"{stats['decode_s']:.2f} s in {stats['steps'] - 1} steps:"]
    for rows, steps, sec in stats.get("segments", []):
        lines.append(f"      {rows:4d} rows: {steps:5d} steps, {sec:6.2f} s, {sec / max(steps, 1) * 1e3:6.2f} ms a step")
    wall, kinds, idle, before, longest = update
    busy = sum(kinds.values())
    lines.append(f"    update: {wall:.2f} s a timed step; one more step's, under the profiler: {busy:.2f} s in kernels"
                 + (f", the GPU idle {idle:.2f} s between them" if idle is not None else "") + ":")
    for kind, sec in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"      {kind:<40} {sec:6.3f} s  {sec / max(busy, 1e-9):5.1%}")
    if before:
        lines.append("      the idle, by the kernel it ended with: " + ", ".join(
            f"{kind} {sec:.3f} s" for kind, sec in sorted(before.items(), key=lambda kv: -kv[1])))
        lines.append("      the longest: " + ", ".join(f"{gap:.3f} s at {at:.2f} s (then {kind})" for gap, kind, at in longest))
    return "\n".join(lines)


def compiled_graphs():
    """How many graphs torch.compile has compiled in this process so far (the update's blocks)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


_kernels = {"compiled": 0, "hooked": False}


def compiled(graphs, kernels):
    return f"{graphs} graphs and {kernels} kernels compiled"


def compiled_kernels():
    """How many of the project's Triton kernels (the engine's and fp4_gemm's) have been compiled in this process
    since the first call, or loaded from Triton's disk cache: a kernel variant first met here, for a plan or a
    launch config first met (torch.compile's own kernels come with its graphs, counted apart). Counted by
    Triton's post-compile hook, chained to any hook set before."""
    if not _kernels["hooked"]:
        try:
            from triton import knobs
        except ImportError:  # (no Triton, or one before 3.4, which has no such hook: the count stays 0)
            return 0
        before = knobs.runtime.jit_post_compile_hook

        def hook(**kwargs):
            _kernels["compiled"] += 1
            return before(**kwargs) if before else None

        knobs.runtime.jit_post_compile_hook = hook
        _kernels["hooked"] = True
    return _kernels["compiled"]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rollout_groups(model, prompts, a, plan, stops, step, kv_cache="model"):
    """The step's rollout as the plan lays it out: calls of plan.rollout_rows rows (whole groups), each keyed
    (ddp.shift_seed) as its rows would be in one call of every prompt, so the samples do not depend on the
    split. → [(the call's first prompt, its Rollout)]."""
    per_call = plan.rollout_rows // a.group_size
    return [(lo, rollout.generate(model, prompts[lo:lo + per_call], n=a.group_size, max_new_tokens=a.new_tokens,
                                  temperature=sampling_temperature(a), stop_ids=stops,
                                  seed=ddp.shift_seed(step, lo * a.group_size),
                                  kv_cache=kv_cache))
            for lo in range(0, len(prompts), per_call)]


def training_batch(calls, correct, prompts, device):
    """train.py's stages 2-4 with `correct` (prompts, G) standing in for the graded rewards: the groups of every
    call (train.groups_of), their advantages, the batch (truncated completions kept: update_config says why)."""
    groups = []
    for lo, ro in calls:
        n = ro.tokens.shape[0] // correct.shape[1]
        part = correct[lo:lo + n]
        zero = torch.zeros_like(part)
        groups += train.groups_of(list(range(lo, lo + n)), torch.stack([part, zero, zero, ro.lengths.view(n, -1).float().cpu()]), ro)
    return train.training_batch(groups, grpo.group_advantages(correct), prompts.__getitem__, False, device)


def decode_floor_s(segments, weights, kv_token, group_size, prompt_len, copy_tb_s):
    """The floor of a rollout call's decode (segments: (rows, forwards, seconds) at each batch size, in order):
    each forward reads the weights once and the KV cache of its live rows, the fewest groups they can hold
    reading their shared prompt once (the engine reads a group's prompt once for all its samples). → s."""
    floor, t = 0.0, 1  # t: new tokens in the cache at the segment's first forward
    for rows, forwards, _ in segments:
        kv_tokens = math.ceil(rows / group_size) * prompt_len + rows * (t + (forwards - 1) / 2)
        floor += forwards * floor_ms(weights, kv_token, kv_tokens, copy_tb_s) / 1e3
        t += forwards
    return floor


def timed_step(model, optimizer, params, prompts, a, plan, ua, stops, gen, step, device, cuda, kv_cache="model",
               update=None):
    """One RL step: rollout (in the plan's calls), the cache released where the plan says, the reward stand-in,
    one update (train.update, or `update` in its place: a profiled one). → (a row of timings and peaks, the
    update's metrics, its batch, the rollout calls)."""
    sync(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model.eval()
    with torch.no_grad():
        calls = rollout_groups(model, prompts, a, plan, stops, step, kv_cache)
    sync(device)
    t1 = time.time()
    peak_rollout = torch.cuda.max_memory_allocated() if cuda else float("nan")
    if not plan.keep_cache:
        rollout.release(model)  # the update needs the cache's memory; the next rollout allocates and captures again
    correct = torch.randint(0, 2, (a.prompts, a.group_size), generator=gen).float()  # the reward stand-in
    sync(device)
    t2 = time.time()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    batch = training_batch(calls, correct, prompts, device)
    metrics = (update or train.update)(ua, model, optimizer, params, batch)
    sync(device)
    t3 = time.time()
    calls = [ro for _, ro in calls]
    gen_tokens = sum(int(ro.lengths.sum()) for ro in calls)
    upd_tokens = gen_tokens + a.prompts * a.group_size * a.prompt_len
    stat = lambda k: sum(ro.stats[k] for ro in calls)
    row = dict(rollout_s=t1 - t0, update_s=t3 - t2, other_s=t2 - t1, step_s=t3 - t0,
               rollout_tok_s=gen_tokens / (t1 - t0), update_tok_s=upd_tokens / (t3 - t2),
               mean_len=gen_tokens / (a.prompts * a.group_size), capture_s=stat("capture_s"), decode_s=stat("decode_s"),
               prefill_s=stat("prefill_s"), mismatch_kl=float("nan") if a.early_stop else metrics["mismatch_kl"],
               peak_rollout_gb=peak_rollout / 2**30,
               peak_update_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan"),
               micro_batches=metrics["micro_batches"])
    return row, metrics, batch, calls


def run_mode(a, mode, device, cfg, plan=None, copy_tb_s=None):
    """Plan the step (step_plan, in what this process may use on `device`, unless `plan` is given), build a
    random model of cfg's shape with `mode` base weights, run 1 + a.steps RL steps, and return the first
    step's timings and the mean of the last a.steps, the peaks, the floors (where copy_tb_s, the card's
    copy bandwidth in TB/s, is known) and the graphs compiled in the timed steps."""
    cuda = device.type == "cuda"
    if plan is None:
        plan = step_plan(a, cfg, mode, memory.gpu_budget(device, a.mem_cap_gb))
    res = dict(mode=mode, size=a.size, plan=plan.settings(), plan_table=plan.describe(), fits=plan.fits)
    if not plan.fits:
        return res
    if cuda:
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model = random_model(cfg, "bf16" if mode == "bf16" else "nvfp4", device)
    params = lora.apply_lora(model, rank=a.lora_rank, alpha=a.lora_rank)
    # nonzero B (apply_lora returns A0, B0, A1, B1, ...), as after some training, so the adapters do real work
    for b in params[1::2]:
        b.data.normal_(0, 1e-3)
    model.compile_blocks = train.compile_backend(device, a.no_compile)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    sync(device)
    res["build_s"] = time.time() - t0
    res["built_gb"] = torch.cuda.memory_allocated() / 2**30 if cuda else float("nan")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=gen).tolist() for _ in range(a.prompts)]
    stops = stop_ids(a, cfg.vocab_size)
    ua = update_config(a, plan, fp8=mode == "nvfp4+fp8")
    weights, kv_token = step_bytes(model), memory.kv_bytes_per_token(cfg, model.dtype, kv_cache_of(mode))
    rows = []
    for step in range(a.steps + 1):  # step 0 warms up (compilation, graph capture, autotuning)
        graphs, kernels = compiled_graphs(), compiled_kernels()
        row, metrics, batch, calls = timed_step(model, optimizer, params, prompts, a, plan, ua, stops, gen,
                                                step, device, cuda, kv_cache_of(mode))
        if copy_tb_s:
            row["decode_floor_s"] = sum(decode_floor_s(ro.stats["segments"], weights, kv_token, a.group_size,
                                                       a.prompt_len, copy_tb_s) for ro in calls)
            row["decode_share"] = row["decode_floor_s"] / row["decode_s"]
        row["graphs_compiled"], row["kernels_compiled"] = compiled_graphs() - graphs, compiled_kernels() - kernels
        rows.append(row)
        print(f"    {mode} step {step}{' (warm-up)' if not step else ''}: {row['step_s']:.1f} s = rollout "
              f"{row['rollout_s']:.1f} (captures {row['capture_s']:.1f}) + update {row['update_s']:.1f} "
              f"({row['micro_batches']} micro-batches) + other {row['other_s']:.1f}; peak {row['peak_rollout_gb']:.1f} / "
              f"{row['peak_update_gb']:.1f} GiB; {compiled(row['graphs_compiled'], row['kernels_compiled'])}", flush=True)
    first, timed = rows[0], rows[1:]
    counts = ("graphs_compiled", "kernels_compiled")
    res.update({k: sum(r[k] for r in timed) / len(timed) for k in timed[0] if k not in counts})
    res["first_step"] = first
    # each a bug: a timed step met a shape (a token count) anew
    res["recompiles"] = sum(r["graphs_compiled"] for r in timed)
    res["kernel_recompiles"] = sum(r["kernels_compiled"] for r in timed)
    res["peak_rollout_gb"] = max(r["peak_rollout_gb"] for r in rows)
    res["peak_update_gb"] = max(r["peak_update_gb"] for r in rows)
    res["peak_gb"] = max(res["peak_rollout_gb"], res["peak_update_gb"])
    if a.profile:  # one more step, its update under the profiler: an update right after a rollout, as a timed
        # step's is (the same batch updated again runs without the host stalls that this one may meet)
        found = {}

        def profiled(*args):
            found["profile"] = profile_update(lambda: found.setdefault("metrics", train.update(*args)), device)
            return found["metrics"]

        _, _, _, calls = timed_step(model, optimizer, params, prompts, a, plan, ua, stops, gen, a.steps + 1, device,
                                    cuda, kv_cache_of(mode), update=profiled)
        res["profile"] = profile_text(mode, calls[-1].stats, (res["update_s"], *found["profile"]))
    res.update(grad_norm=metrics["grad_norm"], checkpointing="on" if metrics["checkpointing"] else "off",
               micro_batch=plan.micro_batch, logp_chunk=plan.logp_chunk, rollout_rows=plan.rollout_rows,
               rollout_calls=plan.rollout_calls, keep_cache=plan.keep_cache)
    if a.decode_batch1:
        res.update(batch1(model, prompts[0], a, weights, kv_token, copy_tb_s, device))
    rollout.release(model)
    del model, params, optimizer, batch, calls
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return res


def batch1(model, prompt, a, weights, kv_token, copy_tb_s, device):
    """One prompt, one completion of --new-tokens tokens: tok/s (prefill included), ms a decode step, and that
    step's floor (weights and the KV cache at the decode's mean column) and share."""
    with torch.no_grad():
        # the warm-up at the timed call's shape, whose graphs it captures (a shorter one makes another state,
        # and the timed call would capture its own)
        rollout.generate(model, [prompt], n=1, max_new_tokens=a.new_tokens, stop_ids=(), seed=0)
        sync(device)
        t0 = time.time()
        ro = rollout.generate(model, [prompt], n=1, max_new_tokens=a.new_tokens, stop_ids=(), seed=1)
        sync(device)
    out = dict(batch1_tok_s=int(ro.lengths.sum()) / (time.time() - t0),
               batch1_ms_step=1e3 * ro.stats["decode_s"] / max(1, ro.stats["steps"] - 1))
    if copy_tb_s:
        out["batch1_floor_ms"] = floor_ms(weights, kv_token, a.prompt_len + a.new_tokens / 2, copy_tb_s)
        out["batch1_share"] = out["batch1_floor_ms"] / out["batch1_ms_step"]
    return out


def out_of_memory(mode, plan, error, cuda):
    """A mode that ran out of GPU memory, as a result: in which phase (from the traceback), torch's message
    (what was allocated, reserved, free), the peak so far, beside the plan."""
    import traceback

    names = [f.name for f in traceback.extract_tb(error.__traceback__)]
    phase = next((what for name, what in (("batch1", "batch-1 decode"), ("update", "update"),
                                          ("rollout_groups", "rollout"), ("random_model", "build"))
                  if name in names), "step")
    return dict(mode=mode, fits=True, plan=plan.settings(), plan_table=plan.describe(), oom_phase=phase,
                oom=" ".join(str(error).split()), peak_gb=torch.cuda.max_memory_allocated() / 2**30 if cuda else None)


def mode_lines(r):
    """A mode's result in a few lines: the plan's settings, the first and the steady step, the peaks against
    the plan's, recompiles (loudly), the batch-1 decode against its floor."""
    p = r["plan"]
    if not r["fits"]:
        return [f"  {r['mode']}: does not fit (the plan above says what to lower); nothing run"]
    if "oom" in r:
        peak = f"; the peak so far {r['peak_gb']:.1f} GiB" if r["peak_gb"] is not None else ""
        return [f"  {r['mode']}: OUT OF MEMORY in the {r['oom_phase']} (the plan: {p['peak_rollout_gb']:.1f} GB "
                f"rolling out, {p['peak_update_gb']:.1f} GB updating{peak}): {r['oom']}"]
    f = r["first_step"]
    cache = "kept" if p["keep_cache"] else "released before each update"
    lines = [f"  {r['mode']}: built in {r['build_s']:.0f} s ({r['built_gb']:.1f} GiB); {p['rollout_rows']} rows a rollout "
             f"call ({p['rollout_calls']} a step), cache {cache}, micro-batch {p['micro_batch']}, logprob chunk "
             f"{p['logp_chunk']}, activation checkpointing {r['checkpointing']}",
             f"    first step {f['step_s']:.1f} s (rollout {f['rollout_s']:.1f} + update {f['update_s']:.1f} + other "
             f"{f['other_s']:.1f}; graph captures {f['capture_s']:.1f} s, "
             f"{compiled(f['graphs_compiled'], f['kernels_compiled'])}); "
             f"steady {r['step_s']:.1f} s (rollout {r['rollout_s']:.1f} + update {r['update_s']:.1f} + other "
             f"{r['other_s']:.1f}; captures {r['capture_s']:.1f} s)",
             f"    peak {r['peak_gb']:.1f} GiB: rollout {r['peak_rollout_gb']:.1f}, update {r['peak_update_gb']:.1f} "
             f"(the plan: {p['peak_rollout_gb'] * 1e9 / 2**30:.1f}, {p['peak_update_gb'] * 1e9 / 2**30:.1f})"]
    if "decode_share" in r:
        lines.append(f"    rollout decode {r['decode_s']:.2f} s against a floor of {r['decode_floor_s']:.2f} s "
                     f"({r['decode_share']:.0%})")
    if r["recompiles"] or r["kernel_recompiles"]:
        lines.append(f"    RECOMPILED: {compiled(r['recompiles'], r['kernel_recompiles'])} in the timed steps. A bug, not "
                     f"a cost: a step met a shape (a token count) that the first step had not compiled for; its seconds "
                     f"are in that step's times")
    else:
        lines.append("    recompiles in the timed steps: 0")
    if "batch1_tok_s" in r:
        floor = (f", floor {r['batch1_floor_ms']:.2f} ms ({r['batch1_share']:.0%})" if "batch1_share" in r else "")
        lines.append(f"    decode at batch 1: {r['batch1_tok_s']:.1f} tok/s, {r['batch1_ms_step']:.2f} ms a step{floor}")
    return lines


def fmt_kl(kl):
    """mismatch_kl as the table prints it: '-' where it was not measured (--early-stop)."""
    return "-" if kl != kl else f"{kl:.2e}"


def report(a, header, results):
    """The markdown of a run so far: the header, each mode's plan and lines, the table and the ratios."""
    out = [header, ""]
    for r in results.values():
        out += ["```", r["plan_table"], "```"] + mode_lines(r) + [""]
    ran = {m: r for m, r in results.items() if r["fits"] and "oom" not in r}
    cols = ["rollout_tok_s", "update_tok_s", "rollout_s", "update_s", "other_s", "step_s", "peak_gb"] + \
           (["mean_len", "capture_s"] if a.early_stop else []) + \
           (["batch1_tok_s"] if a.decode_batch1 else [])
    if ran:
        out.append("| base | " + " | ".join(cols) + " | first step s | decode share | recompiles (graphs / kernels) "
                   "| mismatch_kl |")
        out.append("|---" * (len(cols) + 5) + "|")
        for mode, r in ran.items():
            share = f"{r['decode_share']:.0%}" if "decode_share" in r else "-"
            out.append(f"| {mode} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + f" | {r['first_step']['step_s']:.1f} "
                       f"| {share} | {r['recompiles']} / {r['kernel_recompiles']} | {fmt_kl(r['mismatch_kl'])} |")
    b = ran.get("bf16")
    for mode, n in ran.items():
        if b is None or mode == "bf16":
            continue
        out.append(f"\n{mode} / bf16: step time {n['step_s'] / b['step_s']:.2f}x, rollout speed-up "
                   f"{n['rollout_tok_s'] / b['rollout_tok_s']:.2f}x, update speed-up {n['update_tok_s'] / b['update_tok_s']:.2f}x")
        if b.get("capture_s") or n.get("capture_s"):  # a one-time cost: later steps replay those graphs
            out.append(f"without the timed steps' graph captures: step time {n['step_s'] - n['capture_s']:.1f} / "
                       f"{b['step_s'] - b['capture_s']:.1f} s = "
                       f"{(n['step_s'] - n['capture_s']) / (b['step_s'] - b['capture_s']):.2f}x")
    return "\n".join(out)


def main(argv=None):
    if not faulthandler.is_enabled():  # a crash in native code (CUDA, Triton, compile) prints the Python stacks
        faulthandler.enable()
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("engine.bench_step needs a CUDA GPU")
    import triton

    from engine.bench_gemm import copy_bandwidth

    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    if a.mem_cap_gb:
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.mem_cap_gb * 1e9 / total))
    copy_tb_s = copy_bandwidth()  # (before any model: it needs 2 GiB for a moment)
    header = (f"{torch.cuda.get_device_name(0)} ({total / 2**30:.0f} GiB{f', capped at {a.mem_cap_gb} GB' if a.mem_cap_gb else ''}; "
              f"copy {copy_tb_s:.2f} TB/s); torch {torch.__version__}, triton {triton.__version__}; "
              f"Qwen2.5-{a.size} shape, random weights; {a.prompts} prompts x G={a.group_size}, prompt {a.prompt_len}, "
              f"{f'up to {a.new_tokens} new tokens, ~{a.early_stop:g} on average' if a.early_stop else f'{a.new_tokens} new tokens forced'}, "
              f"LoRA r={a.lora_rank} on q,k,v,o,gate,up,down; {a.steps} timed steps")
    print(header, flush=True)
    results = {}
    for mode in a.modes.split(","):
        cfg = qwen25_config(a.size)
        plan = step_plan(a, cfg, mode, memory.gpu_budget(device, a.mem_cap_gb))
        print(plan.describe(), flush=True)
        try:
            results[mode] = run_mode(a, mode, device, cfg, plan=plan, copy_tb_s=copy_tb_s)
        except torch.OutOfMemoryError as e:  # the measured memory beside the plan, and the next mode still runs
            results[mode] = out_of_memory(mode, plan, e, cuda=True)
        gc.collect()
        torch.cuda.empty_cache()
        print("\n".join(mode_lines(results[mode])), flush=True)
        if a.json:  # after every mode: a run cut short keeps what it measured
            write_json(a.json, dict(header=header, device=torch.cuda.get_device_name(0), torch=torch.__version__,
                                    triton=triton.__version__, copy_tb_s=copy_tb_s, args=vars(a),
                                    results={m: {k: v for k, v in r.items() if k not in ("plan_table", "profile")}
                                             for m, r in results.items()}))
        if a.md:
            write_text(a.md, report(a, header, results) + "\n")
    if a.profile:
        print("\nWhere the time goes (one more step after the timed ones: its last rollout call, its update profiled):")
        for r in results.values():
            if "profile" in r:
                print(r["profile"])
    text = report(a, header, results)
    print("\n" + text[text.index("| base |"):] if "| base |" in text else "")
    return results


if __name__ == "__main__":
    main()
    # Everything is printed and written: leave without the interpreter's teardown. On torch 2.11, after two
    # modes' compiled updates in one process, the finalizers that torch.compile's guards leave for exit crashed
    # there (a 72B run: results/fp8_kv.md), turning a complete run's exit status into a segmentation fault.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
