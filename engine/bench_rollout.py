"""Benchmark of the decode engine: tokens/s of rollout.generate at Qwen2.5 shapes, NVFP4 + LoRA vs bf16 + LoRA.

Speeds up nothing itself: it times engine/decode.py (the engine behind rollout.generate on a GPU) on
random-weight models of the real shapes (no checkpoint needed), prompt 256 and 512 new tokens forced,
LoRA r32 unmerged on every projection, AQN noise on; --check first compares the engine's rollout with
rollout.py's plain sampler and one full forward. Its CPU parts are tested in
tests/engine/test_bench_rollout.py. The tables it printed: results/rollout_h200.md.

    python -m engine.bench_rollout --bench                 # (the same as python rollout.py --bench)
    python -m engine.bench_rollout --bench --no-big --batches 16 32 128
    python -m engine.bench_rollout --bench --batches 64 --new-tokens 1024 --early-stop 256   # rows that stop early
    python -m engine.bench_rollout --bench --quants nvfp4 --batches 1 --big-size 72b --json rows.json
    python -m engine.bench_rollout --bench --no-big --batches 64 --new-tokens 2048 --kv-cache fp8   # the FP8 cache
    python -m engine.bench_rollout --bench --quants nvfp4 --no-big --batches 1 --timeline 1 8 64   # kernel by kernel

Each row is set against its floor: the bytes a decode step must read at least (every weight it touches
once, and each row's KV cache up to its column, at the decode's mean column: prompt + new tokens / 2)
over this card's copy bandwidth, measured in the same run; its share is floor / measured time a step.
--json writes the rows (with their floors, the card and the versions), --bench-out the markdown table.
Where a step goes: --profile sums each kind of kernel's time over eager steps, set against what it reads;
--timeline traces the graphed step as it runs and shares its time out among the kernels (timeline_shares), so
that kernels overlapping one another are counted once and the shares add up to the step.

The random models are built on the GPU (random_model): an NVFP4 one directly in NVFP4, each linear's
codes and block scales drawn from a pool of quantized N(0, std) blocks, so that no bf16 copy of a layer
is ever made (a bf16 72B would be 145 GB) and each block costs one gather.
"""
import argparse
import collections
import gc
import heapq
import json
import os
import tempfile
import time
from types import SimpleNamespace

import torch
import torch.nn as nn
import triton

import fp4_gemm
import lora
import memory
import nvfp4
import rollout
from engine.bench_gemm import copy_bandwidth, write_json
from engine.decode import generate
from hub import write_text
from model import RMSNorm, Transformer, qwen25_config
from rollout import release

POOL_BLOCKS = 2**20  # quantized N(0, std) blocks that random_model draws every NVFP4 linear's blocks from


def nvfp4_pool(std, blocks, device, gen):
    """`blocks` blocks of 16 N(0, std) weights quantized to NVFP4 under one global scale: (codes (blocks,)
    int64, each a block's 16 codes as 8 packed bytes; scales (blocks,) uint8, the E4M3 bytes; global_scale
    (1,) float32)."""
    w = torch.randn(blocks // 64, 64 * nvfp4.BLOCK, generator=gen, device=device) * std  # (rows, 1024)
    q = nvfp4.quantize(w)
    return q.packed.view(torch.int64).reshape(-1), q.scale.view(torch.uint8).reshape(-1), q.global_scale


def draw_nvfp4_(layer, pool, gen):
    """Fill a QuantLinear with blocks drawn uniformly, with replacement, from pool (nvfp4_pool): its
    dequantized weight is N(0, std) quantized, blocks i.i.d. as in a quantized random matrix, at the cost of
    one gather of 9 bytes a block (no bf16 weight is made)."""
    codes, scales, global_scale = pool
    n = layer.out_features * layer.in_features // nvfp4.BLOCK
    pick = torch.randint(0, codes.numel(), (n,), generator=gen, device=codes.device)
    layer.weight_packed.view(torch.int64).view(-1).copy_(codes[pick])  # (N, K/2) bytes = (N, K/16) blocks
    layer.weight_scale.view(torch.uint8).view(-1).copy_(scales[pick])
    layer.weight_global_scale.copy_(global_scale.expand_as(layer.weight_global_scale))


def random_model(cfg, quant, device, seed=0, std=0.02, dtype=torch.bfloat16, pool_blocks=POOL_BLOCKS):
    """A model of cfg's shape with random weights, for the benchmarks. bf16: Transformer.from_random. NVFP4:
    built in NVFP4 on `device`, the model allocated once (embeddings and lm_head N(0, std) in `dtype`,
    norms 1, biases N(0, std)) and every decoder linear drawn from one pool of quantized N(0, std) blocks
    (draw_nvfp4_), where Transformer.from_random(quantize=True) makes and quantizes a bf16 weight per linear,
    many passes over each (estimates: results/memory_plan.md)."""
    device = torch.device(device)
    if quant == "bf16":
        return Transformer.from_random(cfg, dtype, device, quantize=False, seed=seed, std=std)
    if quant != "nvfp4":
        raise ValueError(f"random_model: quant {quant!r}: nvfp4 or bf16")
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.device("meta"):
        model = Transformer(cfg, dtype)
        model.swap_linears(lambda name, m: fp4_gemm.QuantLinear(m.in_features, m.out_features, m.bias is not None,
                                                                 dtype=dtype), fp4_gemm.is_decoder_linear)
    model.materialize(device)
    pool = nvfp4_pool(std, pool_blocks, device, gen)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, fp4_gemm.QuantLinear):
                draw_nvfp4_(m, pool, gen)
            elif isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.normal_(0, std, generator=gen)
            elif isinstance(m, RMSNorm):
                m.weight.fill_(1.0)
            if getattr(m, "bias", None) is not None:
                m.bias.normal_(0, std, generator=gen)
    return model.eval()


def _add_lora(model, rank, seed=0):
    """LoRA rank `rank` on all seven projections, with nonzero B (B = 0 would still cost the same, but
    a nonzero adapter proves the step really adds it)."""
    lora.apply_lora(model, rank=rank, alpha=2 * rank, dtype=torch.float32)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    with torch.no_grad():
        for m in lora.lora_modules(model).values():
            m.lora_B.weight.normal_(0, 1e-3, generator=gen)


def random_stop_ids(vocab, mean_len, gen):
    """A stop list that ends a random-weights rollout's rows after ~mean_len tokens on average: such a model
    picks nearly uniform tokens, so vocab / mean_len random ids (drawn with `gen`) end a row with that
    chance a token, geometrically (a long tail, as real completions have). For the benchmarks."""
    return torch.randperm(vocab, generator=gen)[: max(1, round(vocab / mean_len))].tolist()


# The temperature at which the early-stop benchmarks sample, so that what they compare decodes the same
# lengths. The sampler draws argmax(logits / T + Gumbel noise), the noise a pure function of (row, step)
# (rollout.gumbel_noise); a random model's logits spread ~1, so at T = 1e5 they move a draw by ~1e-5 against
# noise gaps of order 1: the same tokens (and stop tokens) whatever the base or the kernels' rounding.
PAIRED_TEMPERATURE = 1e5


def mean_length(text):
    """argparse type of --early-stop: a mean completion length in tokens (>= 1), or 0 for none."""
    value = float(text)
    if value and value < 1:
        raise argparse.ArgumentTypeError(f"a mean completion length in tokens (>= 1), or 0 for none; got {value:g}")
    return value


def _bench_one(model, batch, prompt_len, new_tokens, seed, **kw):
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, V, (batch, prompt_len), generator=gen).tolist()
    warm = generate(model, prompts, max_new_tokens=new_tokens, stop_ids=(), seed=seed, **kw)  # compile + capture
    r = generate(model, prompts, max_new_tokens=new_tokens, stop_ids=(), seed=seed + 1, **kw)
    s = r.stats
    assert int(r.lengths.min()) == new_tokens, "a row stopped early in the forced-length benchmark"
    return dict(batch=batch, tok_s=batch * new_tokens / (s["prefill_s"] + s["decode_s"]),
                ms_step=1e3 * s["decode_s"] / max(1, s["steps"] - 1), prefill_ms=1e3 * s["prefill_s"],
                prefill=s["prefill"], first_prefill_ms=1e3 * warm.stats["prefill_s"], capture_s=warm.stats["capture_s"],
                graphs=s["graphs"], kernels=s["kernels"])


def _bench_early_stop(model, batch, prompt_len, new_tokens, mean_len, seed, rounds=3, **kw):
    """Rows that stop after ~mean_len tokens on average (random_stop_ids). The same `rounds` rollouts (seeds)
    with and without moving the live rows into smaller states (generate's compact), each timed after a first
    call with its seed, which compiles and captures what that rollout needs. Sampled at PAIRED_TEMPERATURE: the
    GEMMs of fewer rows round differently, which at temperature 1 flips a near-tie now and then and with it a
    row's length, and a rollout runs as long as its longest row. Returns {compact: totals over the rounds}."""
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, V, (batch, prompt_len), generator=gen).tolist()
    stops = random_stop_ids(V, mean_len, gen)
    res = {}
    for compact in (False, True):
        def rollouts():
            return [generate(model, prompts, max_new_tokens=new_tokens, temperature=PAIRED_TEMPERATURE,
                             stop_ids=stops, seed=seed + 1 + i, compact=compact, **kw) for i in range(rounds)]
        rollouts()  # compiles and captures
        rs = rollouts()
        secs = sum(r.stats["prefill_s"] + r.stats["decode_s"] for r in rs)
        lengths = torch.cat([r.lengths.cpu() for r in rs])
        res[compact] = dict(s=secs / rounds, tok_s=int(lengths.sum()) / secs, steps=[r.stats["steps"] for r in rs],
                            shrinks=rs[0].stats["shrinks"], mean=float(lengths.float().mean()),
                            longest=[int(r.lengths.max()) for r in rs], stopped=sum(r.finish.count("stop") for r in rs))
    return res


def _check(model):
    """On the GPU, at the real shape: the graphed Triton step against rollout.py's plain sampler (same seed)
    and both against one full forward pass over the finished sequences (with fp4_gemm's kernels and
    with its torch reference path); for an NVFP4 model also the fused q|k|v GEMM against the separate
    layers and the dequantized reference. Returns lines to print."""
    V = model.config.vocab_size
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (37, 100, 5)]
    kw = dict(n=2, max_new_tokens=48, temperature=1.0, top_p=0.95, seed=3)
    fast = generate(model, prompts, **kw)
    ref = rollout.generate(model, prompts, kernels="torch", graphs=False, **kw)  # the plain sampler
    release(model)
    lines = [f"check: graphed Triton step vs rollout.py's plain sampler, same seed: "
             f"{100 * (fast.tokens == ref.tokens).float().mean().item():.1f}% of tokens equal"]

    def full_lp(r, backend):
        out = []
        for i in range(r.tokens.shape[0]):
            comp, p = r.tokens[i, : int(r.lengths[i])].tolist(), prompts[i // 2]
            with torch.no_grad(), fp4_gemm.backend(backend):
                z = model(torch.tensor([p + comp], device=model.device))[0, len(p) - 1: len(p) - 1 + len(comp)].float()
            out.append(torch.log_softmax(z, -1).gather(1, torch.tensor(comp, device=z.device)[:, None])[:, 0])
        return out

    for name, r in (("graphed Triton", fast), ("plain sampler", ref)):
        for backend in ("auto", "torch"):
            d = [(r.logprobs[i, : len(x)] - x).abs() for i, x in enumerate(full_lp(r, backend))]
            first, rest = torch.stack([x[0] for x in d]), torch.cat([x[1:] for x in d])
            lines.append(f"    {name} step vs full forward (fp4 backend {backend}): |dlogprob| first token "
                         f"mean {first.mean():.2e}, later tokens mean {rest.mean():.2e} max {rest.max():.2e}")
    att = model.layers[0].self_attn
    mods = [getattr(att, n) for n in ("q_proj", "k_proj", "v_proj")]
    bases = [m.base if isinstance(m, lora.LoRALinear) else m for m in mods]
    if all(isinstance(b, fp4_gemm.QuantLinear) for b in bases):
        fused = fp4_gemm.QuantLinear.concat(bases)
        w = torch.cat([b.dequantized_weight(torch.float32) for b in bases])  # (N, K)
        bias = torch.cat([b.bias.float() for b in bases]) if bases[0].bias is not None else 0
        for M in (1, 6, 64, 300, 2048):
            x = torch.randn(M, w.shape[1], device=w.device, dtype=model.dtype)
            y = x.float() @ w.t() + bias
            err = lambda t: ((t.float() - y).norm() / y.norm()).item()
            with torch.no_grad():
                sep = torch.cat([b(x) for b in bases], -1)
                lines.append(f"    fp4 layer-0 q|k|v, M={M}: rel err fused {err(fused(x)):.1e}, separate {err(sep):.1e}")
    return "\n".join(lines)


def step_bytes(model):
    """Bytes one decode step must read at least: every weight the step touches once (embeddings:
    one row, ignored), LoRA adapters in the model dtype."""
    n = 0
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if name.startswith("embed_tokens") and not model.config.tie_word_embeddings:
            continue
        n += t.numel() * (model.dtype.itemsize if ".lora_" in name else t.element_size())
    return n


def floor_ms(weight_bytes, kv_token_bytes, kv_tokens, copy_tb_s):
    """A decode step's floor: its weights and `kv_tokens` tokens of KV cache read once, at the copy bandwidth
    (TB/s). → ms."""
    return (weight_bytes + kv_tokens * kv_token_bytes) / copy_tb_s / 1e9


# The profile's kernel groups that read weights or the cache (step_reads sets them against those reads);
# kernel_group names the rest too.
FP4_GEMM, K_ORDER, LORA_A, LORA_B = "fp4 gemm", "fp4 gemm: x in K order", "LoRA A (small_linear)", "LoRA B"
CUBLAS, ATTENTION, CUBLAS_REDUCE = "cuBLAS (lm_head, LoRA, bf16 base)", "attention", "cuBLAS split-K reduces"


def kernel_group(k):
    """The profile group of the GPU kernel named `k`."""
    return (FP4_GEMM if k.startswith(("_mma_kernel", "_wgmma_kernel", "_wgmma_ws_kernel", "_gemv_kernel",
                                      "_tiled_kernel", "_splitk_reduce", "_dequant_kernel")) else
            K_ORDER if k.startswith("_k_order_kernel") else
            LORA_A if k.startswith("_small_kernel") else
            ATTENTION if "_attn_" in k else "rope+write" if "rope" in k else "silu_mul" if "silu" in k else
            "add_rmsnorm" if "rmsnorm" in k else "sampler" if "sample" in k else LORA_B if "lora_b" in k else
            CUBLAS if "gemm" in k.lower() or "gemv" in k.lower() or "cutlass" in k or "sm90" in k or "xmma" in k else
            CUBLAS_REDUCE if "splitKreduce" in k else "other: " + k[:40])


def step_reads(model, batch, columns, kv_cache="model"):
    """What one decode step of `batch` rows at `columns` cache columns must read, in three parts, each with
    the profile groups whose kernels read it: {part: (bytes, groups)}. The rest of a step's kernels (norms,
    RoPE, SiLU, the sampler, split-K reduces) read only activations, so their floor is about zero."""
    quant = sum(t.numel() * t.element_size() for mod in model.modules() if isinstance(mod, fp4_gemm.QuantLinear)
                for t in mod.buffers())
    dense = step_bytes(model) - quant  # lm_head, LoRA, a bf16 base's linears (and the norms' few KB)
    kv = batch * columns * memory.kv_bytes_per_token(model.config, model.dtype, kv_cache)
    return {"NVFP4 weights": (quant, (FP4_GEMM, K_ORDER)),
            "16-bit weights (lm_head, LoRA, a bf16 base, norms)": (dense, (CUBLAS, LORA_A, LORA_B)),
            f"KV cache ({batch} x {columns} columns)": (kv, (ATTENTION,))}


def against_reads(groups, reads, copy_tb_s):
    """The profile's groups {name: ms} set against step_reads: for each part, the bytes, their floor at
    `copy_tb_s` TB/s, the groups' time and the share (floor / time); then the time of the groups that
    read no weights or cache. → lines."""
    lines, seen = [], set()
    for part, (nbytes, names) in reads.items():
        ms = sum(groups.get(n, 0.0) for n in names)
        floor = nbytes / copy_tb_s / 1e9
        seen.update(names)
        lines.append(f"    {part}: {nbytes / 1e9:.3f} GB, floor {floor:.3f} ms; its kernels {ms:.3f} ms"
                     + (f" (share {floor / ms:.0%})" if ms > 0 else ""))
    rest = {n: ms for n, ms in groups.items() if n not in seen}
    lines.append(f"    the rest (activations only, floor ~0): {sum(rest.values()):.3f} ms ("
                 + ", ".join(f"{n} {ms:.3f}" for n, ms in sorted(rest.items(), key=lambda kv: -kv[1])) + ")")
    return lines


def _profile(model, batch, prompt_len, steps=4, copy_tb_s=None, kv_cache="model"):
    """GPU time per kernel over a few eager decode steps (prefill excluded), grouped: where a step goes;
    with `copy_tb_s`, each group set against what it must read (step_reads, against_reads)."""
    from torch.profiler import ProfilerActivity, profile

    V = model.config.vocab_size
    prompts = torch.randint(0, V, (batch, prompt_len), generator=torch.Generator().manual_seed(0)).tolist()
    # (compiles, and leaves a filled cache)
    generate(model, prompts, max_new_tokens=2, graphs=False, stop_ids=(), seed=0, kv_cache=kv_cache)
    dec = model.__dict__["_rollout_decoder"]
    st = next(reversed(dec.states.values()))
    sp = SimpleNamespace(temperature=1.0, top_p=1.0, top_k=0, pad_id=0, stop_ids=())
    with torch.no_grad():
        dec.step(st, sp)  # continue the rollout eagerly, one step outside the profile
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                dec.step(st, sp)
            torch.cuda.synchronize()
    groups = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t <= 0 or e.key.startswith(("Memcpy", "Memset")) or "aten::" in e.key:
            continue
        g = groups.setdefault(kernel_group(e.key), [0.0, 0])
        g[0] += t / steps / 1e3
        g[1] += e.count / steps
    total = sum(v[0] for v in groups.values())
    lines = [f"profile batch {batch}: kernel time per step {total:.3f} ms in {sum(v[1] for v in groups.values()):.0f} launches"]
    for k, (ms, c) in sorted(groups.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"    {k:<40} {ms:7.3f} ms  {c:5.0f} launches")
    if copy_tb_s:  # (the cache holds the prompt, the 2-token rollout, and the steps: about their middle here)
        lines.append(f"  against its reads, at {copy_tb_s:.2f} TB/s:")
        lines += against_reads({k: v[0] for k, v in groups.items()},
                               step_reads(model, batch, prompt_len + 3 + steps // 2, kv_cache), copy_tb_s)
    return "\n".join(lines)


def timeline_kind(e):
    """The timeline's row for a traced kernel (a Chrome-trace event): its profile group, with the attention's
    two kernels apart and each fp4 GEMM by its grid (a layer's GEMMs launch different grids)."""
    g = kernel_group(e["name"])
    if g == ATTENTION:
        return g + (": combine" if "combine" in e["name"] else ": split")
    if g == FP4_GEMM:
        return f"{g} {e['name'].split('(')[0][:16]} grid {tuple(e.get('args', {}).get('grid', ()))}"
    return g


def _yields(e):
    """Whether a traced kernel gives way to the others running beside it in timeline_shares: cuBLAS's, which
    from 2 rows are the decode step's second stream (the LoRA A products and their split-K reduces, started
    beside the K-order launch or the GEMM that the step waits on); lm_head's runs alone."""
    return kernel_group(e["name"]) in (CUBLAS, CUBLAS_REDUCE)


def timeline_shares(kernels, lo, hi, kind=timeline_kind, yields=_yields):
    """Where the GPU's time in (lo, hi] went, from a trace of its kernels on any streams (events with name, ts
    and dur in µs, as a Chrome trace holds them): each instant that some kernel covers goes to the one running
    then that started first, a kernel that `yields` only where nothing else runs. A kernel launched early beside
    the one before it (programmatic dependent launch), or on the second stream beside the main one's, then costs
    only what it adds past them, and the shares and the idle time add up to hi - lo.
    → ({kind(event): µs}, idle µs)."""
    marks = []
    for i, e in enumerate(kernels):
        a, b = max(e["ts"], lo), min(e["ts"] + e["dur"], hi)
        if a < b:
            marks += [(a, 1, i), (b, 0, i)]
    shares, live, gone, t0, idle = collections.defaultdict(float), [], set(), lo, 0.0
    for t, starts, i in sorted(marks):  # (at one instant, ends before starts)
        while live and live[0][-1] in gone:
            heapq.heappop(live)
        if live and t > t0:
            shares[kind(kernels[live[0][-1]])] += t - t0
        elif not live:
            idle += t - t0
        t0 = t
        if starts:
            heapq.heappush(live, (yields(kernels[i]), kernels[i]["ts"], i))
        else:
            gone.add(i)
    return dict(shares), idle + hi - t0


def _timeline(model, batch, prompt_len, new_tokens=48, n=1, **kw):
    """Where the graphed decode step's time goes, kernel by kernel: a forced rollout of `batch` rows (`n` a
    prompt; kw: generate's engine options) traced by torch.profiler (CUPTI records the kernels of each replayed
    graph), its steps in the middle (between sampler ends) shared out by timeline_shares. → lines."""
    from torch.profiler import ProfilerActivity, profile

    V = model.config.vocab_size
    prompts = torch.randint(0, V, (batch // n, prompt_len), generator=torch.Generator().manual_seed(batch)).tolist()
    kw = dict(kw, n=n, max_new_tokens=new_tokens, stop_ids=(), seed=5)
    generate(model, prompts, **kw)  # compiles and captures
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        generate(model, prompts, **kw)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as d:  # (the Chrome trace, not prof.events(): it holds each kernel's grid)
        prof.export_chrome_trace(os.path.join(d, "trace.json"))
        with open(os.path.join(d, "trace.json")) as f:
            ev = [e for e in json.load(f)["traceEvents"] if e.get("cat") == "kernel"]
    ends = sorted(e["ts"] + e["dur"] for e in ev if "_sample_final_kernel" in e["name"])  # one a step
    if len(ends) < 12:
        return [f"timeline batch {batch}: {len(ev)} kernels traced, {len(ends)} steps: too few to read"]
    lo, hi = ends[len(ends) // 3], ends[-4]
    steps = sum(lo < t <= hi for t in ends)
    shares, idle = timeline_shares(ev, lo, hi)
    launches = collections.Counter(timeline_kind(e) for e in ev if lo < e["ts"] + e["dur"] <= hi)
    lines = [f"timeline batch {batch} ({n} a prompt): {(hi - lo) / steps:.1f} us a step over {steps} graphed steps, "
             f"{idle / steps:.1f} of them idle; each kind's share of a step (launches a step):"]
    for k, us in sorted(shares.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {k:<50} {us / steps:8.1f} us  ({launches[k] / steps:.0f})")
    return lines


def _diagnose(notes, prefix, what, make):
    """Print and keep in `notes` the text make() returns (a --timeline or --profile run), or the error it
    raised: a diagnostic that fails leaves the benchmark's table standing."""
    try:
        line = f"{prefix} " + make()
    except Exception as e:
        line = f"{prefix} {what} failed: {type(e).__name__}: {e}"
    print(line, flush=True)
    notes.append(line)


def bench(args):
    """The table of results/rollout_h200.md: Qwen2.5-7B shape (random weights), prompt 256, 512 new tokens
    forced, NVFP4 + LoRA r32 (unmerged) vs bf16 + the same LoRA, batch 1/8/64; then the big model
    (--big-size, 32B by default) NVFP4 at batch 1. Each row's floor (floor_ms): its weights and KV cache read
    once a step at this card's copy bandwidth, measured here."""
    import aqn

    if not torch.cuda.is_available():
        raise SystemExit("rollout.py --bench (engine/bench_rollout.py) needs a CUDA GPU")
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"# {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, "
          f"triton {triton.__version__}")
    copy_tb_s = copy_bandwidth()  # (before any model: it needs 2 GiB of the GPU for a moment)
    print(f"# device copy bandwidth {copy_tb_s:.2f} TB/s (read + write)", flush=True)
    print(f"# prompt {args.prompt_len} tokens, {args.new_tokens} new tokens forced, LoRA rank {args.rank} "
          f"unmerged on q,k,v,o,gate,up,down, AQN sigma {args.aqn_sigma:g} on the decoder norms, the KV cache "
          f"in {args.kv_cache} {'(E4M3, a scale a token and kv head)' if args.kv_cache == 'fp8' else 'dtype'}",
          flush=True)
    rows, notes = [], []
    asked = {"kernels": args.kernels, "graphs": args.graphs, "kv_cache": args.kv_cache}  # (the table's rows)
    models = [("7b", q) for q in args.quants] + ([(args.big_size, "nvfp4")] if args.big else [])
    for size, quant in models:
        gc.collect()
        torch.cuda.empty_cache()
        t0 = time.perf_counter()
        model = random_model(qwen25_config(size), quant, dev, seed=0)
        _add_lora(model, args.rank)
        torch.cuda.synchronize()
        weights = step_bytes(model)
        kv_token = memory.kv_bytes_per_token(model.config, model.dtype, args.kv_cache)
        mean_columns = args.prompt_len + args.new_tokens / 2  # (each row its own prompt here)
        floor_of = lambda batch, new=args.new_tokens: floor_ms(weights, kv_token, batch * (args.prompt_len + new / 2),
                                                               copy_tb_s)
        print(f"# built {size} {quant} + LoRA in {time.perf_counter() - t0:.1f} s, "
              f"{torch.cuda.memory_allocated() / 2**30:.1f} GiB; a step reads >= {weights / 1e9:.2f} GB "
              f"of weights and {kv_token * mean_columns / 1e6:.1f} MB of KV cache a row: floor {floor_of(1):.2f} "
              f"ms at batch 1, at {copy_tb_s:.2f} TB/s", flush=True)
        notes.append(f"{size} {quant}: weights read per step {weights / 1e9:.2f} GB, KV {kv_token * mean_columns / 1e6:.1f} "
                     f"MB a row; floor {floor_of(1):.2f} ms/step at batch 1, at {copy_tb_s:.2f} TB/s")
        runs = [(b, {}) for b in (args.batches if size == "7b" else [1])]  # (the big model: batch 1 alone)
        if args.variants and (size, quant) == ("7b", "nvfp4"):
            runs += [(1, dict(graphs=False)), (1, dict(kernels="torch")), (64, dict(kernels="torch"))]
        with aqn.noise(model, args.aqn_sigma, torch.Generator(dev).manual_seed(0)):
            if args.check and size == "7b":
                try:
                    line = f"{size} {quant} {_check(model)}"
                except Exception as e:
                    line = f"{size} {quant} check failed: {type(e).__name__}: {e}"
                print(line, flush=True)
                notes.append(line)
            for batch, kw in runs:
                kw = {**asked, **kw}
                tokens = args.new_tokens if kw["graphs"] is not False else 64  # eager is slow: fewer steps
                try:
                    res = _bench_one(model, batch, args.prompt_len, tokens, seed=batch, **kw)
                except Exception as e:  # keep the rest of the table
                    line = f"{size} {quant} batch {batch} {kw} failed: {type(e).__name__}: {e}"
                    print(line, flush=True)
                    notes.append(line)
                    continue
                res.update(size=size, quant=quant, kv_cache=args.kv_cache, floor_ms=floor_of(batch, tokens),
                           copy_tb_s=copy_tb_s, weight_gb=weights / 1e9, prompt_len=args.prompt_len, new_tokens=tokens)
                res["share"] = res["floor_ms"] / res["ms_step"]
                line = (f"{size:>4} {quant:>6} batch {batch:>3}: {res['tok_s']:9.0f} tok/s  decode {res['ms_step']:6.2f} "
                        f"ms/step (floor {res['floor_ms']:.2f}: {res['share']:.0%})  prefill {res['prefill_ms']:7.1f} ms "
                        f"({res['prefill']}; the shape's first "
                        f"{res['first_prefill_ms']:.0f})  compile+capture {res['capture_s']:.1f} s  "
                        f"(kernels {res['kernels']}, graphs {res['graphs']})")
                print(line, flush=True)
                if kw == asked:
                    rows.append(res)
                else:
                    notes.append("variant " + line)
                write_outputs(args, props, copy_tb_s, rows, notes)  # (after every row: a run cut short keeps them)
            for batch in (args.batches if args.early_stop and size == "7b" else []):
                r = _bench_early_stop(model, batch, args.prompt_len, args.new_tokens, args.early_stop, seed=batch,
                                      **asked)
                off, on = r[False], r[True]
                how = lambda x: (f"{x['s']:.2f} s a rollout ({x['tok_s']:.0f} tok/s; {x['stopped']} rows stopped, mean "
                                 f"{x['mean']:.0f} tokens, longest {x['longest']}, steps {x['steps']})")
                line = (f"{size:>4} {quant:>6} batch {batch:>3}, rows stopping early, {len(off['steps'])} rollouts each "
                        f"way: {how(off)} as one batch, {how(on)} moving the live rows to fewer (the first: after "
                        f"step, rows {on['shrinks']}): {on['tok_s'] / off['tok_s']:.2f}x the tok/s")
                print(line, flush=True)
                notes.append(line)
            if (size, quant) == ("7b", "nvfp4"):
                for b in args.timeline:
                    _diagnose(notes, f"{size} {quant}", "timeline", lambda: "\n".join(
                        _timeline(model, b, args.prompt_len, n=8 if b % 8 == 0 else 1, **asked)))
                for b in args.profile:
                    _diagnose(notes, f"{size} {quant}", "profile", lambda: _profile(
                        model, b, args.prompt_len, copy_tb_s=copy_tb_s, kv_cache=args.kv_cache))
        release(model)
        del model
    print(_table(rows))
    write_outputs(args, props, copy_tb_s, rows, notes)
    return rows


def write_outputs(args, props, copy_tb_s, rows, notes):
    """The table and notes so far to --bench-out (markdown), the rows to --json."""
    if args.bench_out:
        write_text(args.bench_out, _table(rows) + "\n\n" + "\n".join(notes) + "\n")
    if args.json:
        write_json(args.json, dict(device=props.name, torch=torch.__version__, triton=triton.__version__,
                                   copy_tb_s=copy_tb_s, rows=rows, notes=notes))


def _table(rows):
    """The markdown table: per model and batch, each base's tok/s, ms a step, its floor and share."""
    by = {(r["size"], r["quant"], r["batch"]): r for r in rows}
    lines = ["| model | batch | NVFP4+LoRA tok/s | ms/step | floor ms | share | bf16+LoRA tok/s | ms/step | floor ms "
             "| share | NVFP4 / bf16 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for size in dict.fromkeys(r["size"] for r in rows):
        for b in sorted({r["batch"] for r in rows if r["size"] == size}):
            f4, bf = by.get((size, "nvfp4", b)), by.get((size, "bf16", b))
            cells = lambda r: (f"{r['tok_s']:.0f} | {r['ms_step']:.2f} | {r['floor_ms']:.2f} | {r['share']:.0%}" if r
                               else "- | - | - | -")
            ratio = f"{f4['tok_s'] / bf['tok_s']:.2f}x" if f4 and bf else "-"
            lines.append(f"| Qwen2.5-{size.upper()} shape | {b} | {cells(f4)} | {cells(bf)} | {ratio} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="Benchmark the decode engine (rollout.generate on a GPU): NVFP4 + LoRA "
                                            "vs bf16 + LoRA on random Qwen2.5 shapes.")
    p.add_argument("--bench", action="store_true", help="run the benchmark (the default; kept so that "
                                                        "`python rollout.py --bench ...` passes its flags here)")
    p.add_argument("--bench-out", default=None, help="also write the benchmark table (markdown) here")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows (with their floors, the card "
                   "and the versions) as JSON here")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64], help="benchmark batch sizes")
    p.add_argument("--quants", nargs="+", default=["nvfp4", "bf16"], help="benchmark base formats")
    p.add_argument("--no-big", dest="big", action="store_false", help="skip the big model's NVFP4 batch-1 row")
    p.add_argument("--big-size", default="32b", choices=("14b", "32b", "72b"), help="the big model of the NVFP4 "
                   "batch-1 row (72b: 46 GB of weights)")
    p.add_argument("--prompt-len", type=int, default=256, help="benchmark prompt tokens")
    p.add_argument("--new-tokens", type=int, default=512, help="benchmark new tokens (forced, no stop)")
    p.add_argument("--rank", type=int, default=32, help="benchmark LoRA rank")
    p.add_argument("--aqn-sigma", type=float, default=1e-2, help="benchmark AQN noise sigma on the norm weights")
    p.add_argument("--kernels", default="auto", choices=("auto", "triton", "torch"), help="fused ops: Triton or torch")
    p.add_argument("--graphs", default="auto", choices=("auto", "on", "off"), help="CUDA graphs for the decode step and short prefills")
    p.add_argument("--kv-cache", default="model", choices=rollout.KV_CACHES, help="what the KV cache stores: K/V in "
                   "the model dtype, or fp8 (E4M3 with a scale a token and kv head: rollout.KVCache)")
    p.add_argument("--check", action="store_true", help="benchmark: first check the GPU step against rollout.py's plain sampler and a full forward")
    p.add_argument("--profile", type=int, nargs="*", default=[], help="benchmark: kernel-time profile at these batches")
    p.add_argument("--timeline", type=int, nargs="*", default=[], help="benchmark: where the 7B NVFP4 model's "
                   "graphed step's time goes, kernel by kernel, from a trace of 48 forced steps at these batches (8 "
                   "rows a prompt where the batch is a multiple of 8)")
    p.add_argument("--variants", action="store_true", help="benchmark: also time eager (no graphs) and torch-op steps")
    p.add_argument("--early-stop", type=mean_length, default=0, metavar="MEAN",
                   help="benchmark: also time rollouts whose rows stop after ~MEAN tokens on average (up to "
                        "--new-tokens), as one batch and moving the live rows into smaller states")
    args = p.parse_args(argv)
    args.graphs = {"auto": "auto", "on": True, "off": False}[args.graphs]
    return bench(args)


if __name__ == "__main__":
    main()
