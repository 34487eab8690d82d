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
               torch.compile and activation checkpointing only where a micro-batch would not fit
               without it, as train.py does on a GPU, AdamW on the LoRA parameters)

and prints rollout tokens/s, update tokens/s, the step time split, peak GPU memory
(torch.cuda.max_memory_allocated) and the NVFP4 / bf16 ratios. `--mem-cap-gb 80` caps the process
with torch.cuda.set_per_process_memory_fraction to reproduce an 80 GB card on a larger one.
`--early-stop MEAN` lets the completions stop as real ones do, after ~MEAN tokens on average (a long
tail up to --new-tokens): then the rollout's batch shrinks as its rows finish (engine/decode.py) and the
update sees fewer tokens. The two bases then decode different tokens and so different lengths (the
mean_len column); a timed step may also capture the graph of a batch size the warm-up step did not
reach (capture_s, included in rollout_s). Any step may meet a micro-batch shape that makes torch.compile
compile the update's blocks once more (a one-time cost of seconds, inside update_s): each mode's line says
how many graphs its timed steps compiled.

    python -m engine.bench_step --size 7b                   # bf16 and NVFP4, 8 prompts x 8, 256 + 1024 tokens
    python -m engine.bench_step --size 7b --early-stop 256  # the same, completions of ~256 tokens on average
    python -m engine.bench_step --size 32b --modes nvfp4 --mem-cap-gb 80
    python -m engine.bench_step --size 7b --modes bf16,nvfp4,nvfp4+fp8   # and the update on FP8 tensor cores
    python -m engine.bench_step --size 7b --early-stop 256 --profile       # and where each step's time goes

The last column is the step's sampler-trainer mismatch (grpo.py's mismatch_kl: the rollout's logprobs
against the update's, no AQN here), which --fp8-update raises.
"""
import argparse
import functools
import gc
import time

import torch

import lora
import rollout
import train
from engine.bench_rollout import mean_length, random_stop_ids
from model import Transformer, qwen25_config


MODES = ("bf16", "nvfp4", "nvfp4+fp8")  # the bases: 16-bit, NVFP4, NVFP4 with the update on FP8 tensor cores


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="RL step benchmark: bf16-LoRA vs NVFP4-LoRA on random Qwen2.5 shapes.")
    p.add_argument("--size", default="7b", help="Qwen2.5 shape: 0.5b, 1.5b, 3b, 7b, 14b, 32b")
    p.add_argument("--modes", default="bf16,nvfp4", help="comma-separated bases to compare: bf16, nvfp4, nvfp4+fp8 "
                   "(an NVFP4 base whose update runs on FP8 tensor cores: train.py --fp8-update)")
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
                   "(train.py's: more where completions stop early)")
    p.add_argument("--checkpointing", default="auto", choices=["auto", "on", "off"],
                   help="activation checkpointing in the update, as train.py's (auto: off where a micro-batch fits)")
    p.add_argument("--mem-cap-gb", type=float, default=None, help="cap this process's GPU memory (e.g. 80)")
    p.add_argument("--decode-batch1", action="store_true", help="also time batch-1 rollout tok/s")
    p.add_argument("--no-compile", action="store_true", help="update with eager blocks (as train.py --no-compile)")
    p.add_argument("--profile", action="store_true", help="also say where a step's time goes: the rollout's decode at "
                   "each batch size (its last timed step) and one more update under torch.profiler, by kind of kernel")
    a = p.parse_args(argv)
    if any(m not in MODES for m in a.modes.split(",")):
        p.error(f"--modes {a.modes}: each one of {', '.join(MODES)}, separated by commas")
    if a.steps < 1:  # (the warm-up step is not timed: with none timed there is nothing to report)
        p.error(f"--steps {a.steps}: at least 1 timed step")
    return a


def stop_ids(a, vocab):
    """The rollout's stop list: none (every completion runs --new-tokens), or with --early-stop MEAN the
    same random ids in every mode, which end a completion after ~MEAN tokens on average
    (engine.bench_rollout.random_stop_ids)."""
    if not a.early_stop:
        return ()
    return random_stop_ids(vocab, a.early_stop, torch.Generator().manual_seed(1))


def update_args(a, fp8=False):
    """train.update's knobs for one on-policy DAPO pass: train.py's own defaults (its DAPO recipe), with
    this benchmark's micro-batch, completion length and checkpointing, and truncated completions kept in
    the loss: forced-length ones are all truncated, and masking them would leave the update nothing to do."""
    return train.recipe(train.parse_args(["--algo", "dapo", "--micro-batch", str(a.micro_batch), "--max-new-tokens",
                                          str(a.new_tokens), "--checkpointing", a.checkpointing,
                                          "--no-mask-truncated"] + (["--fp8-update"] if fp8 else [])))


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


def profile_update(run, device):
    """Run one update (`run`) under torch.profiler: (wall s, {kind: kernel s}) with the device's kernels
    (CUDA) or the CPU's operators (the CPU, for the tests) grouped by KINDS."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    sync(device)
    t0 = time.time()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        run()
        sync(device)
    wall = time.time() - t0
    kinds = {}
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) if cuda \
            else e.self_cpu_time_total
        if us <= 0 or (cuda and e.key.startswith(("aten::", "cuda"))):  # (the CPU side of a launch)
            continue
        name = e.key.lower()
        kind = next((k for k, pats in KINDS if any(q in name for q in pats)), "other")
        kinds[kind] = kinds.get(kind, 0.0) + us / 1e6
    return wall, kinds


def profile_text(mode, stats, update):
    """Where a step's time went: the rollout's prefill, its decode at each batch size (engine/decode.py's
    segments: rows, steps, seconds) and graph captures; the update's kernels by kind, and the rest of its
    wall time (the device waiting on the host, or host work)."""
    lines = [f"  {mode}: rollout: prefill {stats['prefill_s'] * 1e3:.0f} ms, captures {stats['capture_s']:.2f} s, decode "
             f"{stats['decode_s']:.2f} s in {stats['steps'] - 1} steps:"]
    for rows, steps, sec in stats.get("segments", []):
        lines.append(f"      {rows:4d} rows: {steps:5d} steps, {sec:6.2f} s, {sec / max(steps, 1) * 1e3:6.2f} ms a step")
    wall, kinds = update
    busy = sum(kinds.values())
    lines.append(f"    update (one more, profiled): {wall:.2f} s wall, {busy:.2f} s in kernels, {max(0.0, wall - busy):.2f} s "
                 f"not (launch gaps, host work):")
    for kind, sec in sorted(kinds.items(), key=lambda kv: -kv[1]):
        lines.append(f"      {kind:<40} {sec:6.3f} s  {sec / max(busy, 1e-9):5.1%}")
    return "\n".join(lines)


def compiled_graphs():
    """How many graphs torch.compile has compiled in this process so far (the update's blocks)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run_mode(a, mode, device, cfg):
    """Build a random model of cfg's shape with `mode` base weights, run 1 + a.steps RL steps, and
    return the timings of the last a.steps."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model = Transformer.from_random(cfg, dtype=torch.bfloat16, device=device, quantize=mode.startswith("nvfp4"))
    params = lora.apply_lora(model, rank=a.lora_rank, alpha=a.lora_rank)
    # nonzero B (apply_lora returns A0, B0, A1, B1, ...), as after some training, so the adapters do real work
    for b in params[1::2]:
        b.data.normal_(0, 1e-3)
    model.compile_blocks = train.compile_backend(device, a.no_compile)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    build_s = time.time() - t0
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (a.prompt_len,), generator=gen).tolist() for _ in range(a.prompts)]
    stops = stop_ids(a, cfg.vocab_size)
    ua = update_args(a, fp8=mode == "nvfp4+fp8")
    rows = []
    for step in range(a.steps + 1):  # step 0 warms up (compilation, graph capture, autotuning)
        if step == 1:
            graphs = compiled_graphs()
        sync(device)
        t0 = time.time()
        model.eval()
        with torch.no_grad():
            ro = rollout.generate(model, prompts, n=a.group_size, max_new_tokens=a.new_tokens, temperature=1.0,
                                  stop_ids=stops, seed=step)
        sync(device)
        t1 = time.time()
        correct = torch.randint(0, 2, (a.prompts, a.group_size), generator=gen).float()  # the reward stand-in
        groups = [dict(item=i, rollout=ro, rows=list(range(i * a.group_size, (i + 1) * a.group_size)))
                  for i in range(a.prompts)]
        metrics = train.update(ua, model, optimizer, params, groups, correct, lambda i: prompts[i], 0.0, 0, device)
        sync(device)
        t2 = time.time()
        if step:
            gen_tokens = int(ro.lengths.sum())
            upd_tokens = gen_tokens + a.prompts * a.group_size * a.prompt_len
            rows.append(dict(rollout_s=t1 - t0, update_s=t2 - t1, step_s=t2 - t0, rollout_tok_s=gen_tokens / (t1 - t0),
                             update_tok_s=upd_tokens / (t2 - t1), mean_len=gen_tokens / len(ro.finish),
                             capture_s=ro.stats["capture_s"], mismatch_kl=metrics["mismatch_kl"]))
    res = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]}
    res["compiles"] = compiled_graphs() - graphs  # in the timed steps: each a one-time cost inside its update_s
    if a.profile:
        again = functools.partial(train.update, ua, model, optimizer, params, groups, correct, prompts.__getitem__, 0.0,
                                  0, device)  # the last step's batch once more
        res["profile"] = profile_text(mode, ro.stats, profile_update(again, device))
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    res.update(mode=mode, build_s=build_s, peak_gb=peak, grad_norm=metrics["grad_norm"],
               checkpointing="on" if metrics["checkpointing"] else "off")
    if a.decode_batch1:
        with torch.no_grad():
            # the warm-up at the timed call's shape, whose graphs it captures (a shorter one makes another state,
            # and the timed call would capture its own)
            rollout.generate(model, prompts[:1], n=1, max_new_tokens=a.new_tokens, stop_ids=(), seed=0)
            sync(device)
            t0 = time.time()
            ro = rollout.generate(model, prompts[:1], n=1, max_new_tokens=a.new_tokens, stop_ids=(), seed=1)
            sync(device)
        res["batch1_tok_s"] = int(ro.lengths.sum()) / (time.time() - t0)
    rollout.release(model)
    del model, params, optimizer, ro
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return res


def main(argv=None):
    a = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("engine.bench_step needs a CUDA GPU")
    device = torch.device("cuda")
    total = torch.cuda.get_device_properties(0).total_memory
    if a.mem_cap_gb:
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.mem_cap_gb * 1e9 / total))
    print(f"{torch.cuda.get_device_name(0)} ({total / 2**30:.0f} GiB{f', capped at {a.mem_cap_gb} GB' if a.mem_cap_gb else ''}); "
          f"Qwen2.5-{a.size} shape, random weights; {a.prompts} prompts x G={a.group_size}, prompt {a.prompt_len}, "
          f"{f'up to {a.new_tokens} new tokens, ~{a.early_stop:g} on average' if a.early_stop else f'{a.new_tokens} new tokens forced'}, "
          f"LoRA r={a.lora_rank} on q,k,v,o,gate,up,down; {a.steps} timed steps")
    results = {}
    for mode in a.modes.split(","):
        results[mode] = run_mode(a, mode, device, qwen25_config(a.size))
        r = results[mode]
        print(f"  {mode}: built in {r['build_s']:.0f} s, step {r['step_s']:.1f} s, peak {r['peak_gb']:.1f} GiB, "
              f"activation checkpointing {r['checkpointing']}, {r['compiles']} graphs compiled in the timed steps",
              flush=True)
    cols = ["rollout_tok_s", "update_tok_s", "rollout_s", "update_s", "step_s", "peak_gb"] + \
           (["mean_len", "capture_s"] if a.early_stop else []) + (["batch1_tok_s"] if a.decode_batch1 else [])
    if a.profile:
        print("\nWhere the time goes (the last timed step's rollout; one more update, profiled):")
        for r in results.values():
            print(r["profile"])
    print("\n| base | " + " | ".join(cols) + " | mismatch_kl |")
    print("|---" * (len(cols) + 2) + "|")
    for mode, r in results.items():
        print(f"| {mode} | " + " | ".join(f"{r[c]:.1f}" for c in cols) + f" | {r['mismatch_kl']:.2e} |")
    b = results.get("bf16")
    for mode, n in results.items():
        if b is None or mode == "bf16":
            continue
        print(f"\n{mode} / bf16: step time {n['step_s'] / b['step_s']:.2f}x, rollout speed-up "
              f"{n['rollout_tok_s'] / b['rollout_tok_s']:.2f}x, update speed-up {n['update_tok_s'] / b['update_tok_s']:.2f}x")
        if b.get("capture_s") or n.get("capture_s"):  # a one-time cost: later steps replay those graphs
            print(f"without the timed steps' graph captures: step time {n['step_s'] - n['capture_s']:.1f} / "
                  f"{b['step_s'] - b['capture_s']:.1f} s = {(n['step_s'] - n['capture_s']) / (b['step_s'] - b['capture_s']):.2f}x")
    return results


if __name__ == "__main__":
    main()
