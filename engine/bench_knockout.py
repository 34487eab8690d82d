"""What each kind of small kernel costs the graphed decode step: the step timed with that kind taken out.

Speeds up nothing: a diagnostic beside `engine.bench_rollout --profile`. The profile sums kernel time over
eager steps, but in the CUDA graph the kernels overlap (programmatic dependent launch starts each one
before the one ahead ends; the LoRA A products run on a second stream), so a kernel's own time is not what
it costs the step. Here the graphed step (engine/decode.py) is timed whole, then again with one kind of
kernel taken out: its output replaced by a buffer of zeros of the same shape, made once before the graph
is captured. The step keeps its shapes and every other launch, but not its numbers (its tokens are
garbage; every row runs the forced length). What the step saves is what that kind costs its critical
path: the kernels' time and the wait each launch adds, less what overlapped.

    python -m engine.bench_knockout                                 # 7B NVFP4 + LoRA r32, 1 / 2 / 8 / 64 rows
    python -m engine.bench_knockout --quant bf16 --batches 1 8 --rounds 3 --json knockout.json
    python -m engine.bench_knockout --batches 8 32 64 --samples 8        # 8 rows a prompt, as RL groups

The kinds (KINDS), each a method of engine/decode.py's Decoder:
  lora_b      the LoRA B products added in place after o and down (Decoder.project)
  attention   the decode attention: its split over the cache and the combine (Decoder.attention)
  rope_write  LoRA B of q|k|v, the rotary embedding, the K/V write (Decoder.rope_write)
  silu_mul    LoRA B of gate|up, SiLU and the product (Decoder.silu_mul)
  side        the LoRA A products from 2 rows on: cuBLAS on the second stream on Hopper (Decoder.gemm; at
              one row they ride in the mma GEMM's own launch, and stay)
and all of them at once: what is left is the GEMMs, the norms, lm_head and the sampler. The variants run
in turns, in reverse order every other round, so that the GPU's slowing as it warms lands on each.
Tested on the CPU (tests/engine/test_bench_knockout.py); measured: results/engine_floor_h100.md.
"""
import argparse
import contextlib
import time

import torch
import triton

import aqn
import memory
from engine import decode
from engine.bench_gemm import SIZES, copy_bandwidth, write_json
from engine.bench_rollout import _add_lora, _bench_one, floor_ms, random_model, step_bytes
from engine.korder import fp4_linear_k_ordered
from model import qwen25_config
from rollout import release

# each kind, and the Decoder method whose kernels it is
METHODS = dict(lora_b="project", attention="attention", rope_write="rope_write", silu_mul="silu_mul", side="gemm")
KINDS = tuple(METHODS)


@contextlib.contextmanager
def taken_out(kinds):
    """Decoder's steps with `kinds` (of KINDS) replaced by zeros of their outputs' shapes, inside the block.
    A decoder built or captured inside keeps reading those zeros: release(model) before using it outside."""
    unknown = set(kinds) - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}; use some of {', '.join(KINDS)}")
    D = decode.Decoder
    kept = {name: getattr(D, name) for name in METHODS.values()}
    zeros = {}  # (rows, columns, the next GEMM's x order, dtype, device) -> a buffer, made in the eager warm-up

    def zeros_like_output(M, N, order, like):
        key = (M, N, order, like.dtype, like.device)
        if key not in zeros:
            zeros[key] = decode._output(M, N, order, like).zero_()
        return zeros[key]

    def project(self, grp, x, order=decode.NATURAL):
        return self.gemm(grp, x, order)[0] if grp.R else kept["project"](self, grp, x, order)

    def attention(self, q, st, layer, terms, order=decode.NATURAL):
        return zeros_like_output(q.shape[0], q.shape[1] * q.shape[2], order, q)

    def rope_write(self, qkv, a, grp, st, layer, terms):
        c = self.cfg
        return zeros_like_output(qkv.shape[0], c.num_heads * c.head_dim, decode.NATURAL, qkv).view(
            qkv.shape[0], c.num_heads, c.head_dim)

    def silu_mul(self, gu, a, grp, order=decode.NATURAL):
        return zeros_like_output(gu.shape[0], gu.shape[1] // 2, order, gu)

    def gemm(self, grp, x, order=decode.NATURAL):
        if not grp.R or x.shape[0] < 2:
            return kept["gemm"](self, grp, x, order)
        y = fp4_linear_k_ordered(x, grp.gemm.q, grp.gemm.bias) if order[0] else grp.gemm(x)
        return y, zeros_like_output(x.shape[0], grp.A.shape[0], decode.NATURAL, x)

    mine = dict(project=project, attention=attention, rope_write=rope_write, silu_mul=silu_mul, gemm=gemm)
    for kind in kinds:
        setattr(D, METHODS[kind], mine[METHODS[kind]])
    try:
        yield
    finally:
        for name, f in kept.items():
            setattr(D, name, f)


def variants(kinds=KINDS):
    """{name: kinds taken out}: the step as it is, each kind alone, and all of `kinds` together (with every
    kind out, what is left is the GEMMs, the norms, lm_head and the sampler)."""
    out = {"as is": (), **{f"no {k}": (k,) for k in kinds}}
    if len(kinds) > 1:
        every = set(kinds) == set(KINDS)
        out["GEMMs, norms, lm_head, sampler only" if every else "no " + ", ".join(kinds)] = tuple(kinds)
    return out


def measure(model, batches, rounds=2, new_tokens=192, prompt_len=256, kinds=KINDS, samples=1, report=print, **kw):
    """ms a decode step of `model` at each of `batches` rows (engine.bench_rollout._bench_one: forced length),
    for every variant, in turns; `samples` rows share each prompt, as an RL rollout's group does (fewer where
    a batch has fewer rows). → rows [{variant, round, batch (rows), prompts, ms_step}]."""
    out, taken = [], variants(kinds)
    names = list(taken)
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            release(model)  # (graphs captured for another variant read its zeros)
            with taken_out(taken[name]):
                for b in batches:
                    n = min(samples, b)
                    r = _bench_one(model, b // n, prompt_len, new_tokens, seed=b, n=n, **kw)
                    out.append(dict(variant=name, round=rnd, batch=b, prompts=r["batch"], ms_step=r["ms_step"]))
                    report(out[-1])
            release(model)
    return out


def table(rows, floors=None):
    """Markdown: ms a step per variant and batch (each round's, then what taking the kind out saved against
    the step as it is, on the rounds' means)."""
    batches = sorted({r["batch"] for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows if r["round"] == 0))
    ms = {(n, b): [r["ms_step"] for r in rows if (r["variant"], r["batch"]) == (n, b)] for n in names for b in batches}
    mean = lambda v: sum(v) / len(v)
    lines = ["| variant | " + " | ".join(f"{b} row{'s' if b > 1 else ''}: ms (saved)" for b in batches) + " |",
             "| --- |" + " --- |" * len(batches)]
    for n in names:
        cells = [" / ".join(f"{v:.3f}" for v in ms[(n, b)]) + ("" if n == "as is" else
                 f" ({mean(ms[('as is', b)]) - mean(ms[(n, b)]):+.3f})") for b in batches]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    if floors:
        lines.append("| floor (weights and KV cache read once) | " + " | ".join(f"{floors[b]:.3f}" for b in batches)
                     + " |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description="What each kind of small kernel costs the graphed decode step: the step "
                                            "timed with that kind taken out (wrong numbers, the same shapes).")
    p.add_argument("--size", default="7b", choices=SIZES, help="Qwen2.5 shape (random weights)")
    p.add_argument("--quant", default="nvfp4", choices=("nvfp4", "bf16"), help="the base's format")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 2, 8, 64], help="rows a step")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="the kinds to take out")
    p.add_argument("--rounds", type=int, default=2, help="turns through the variants")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    p.add_argument("--samples", type=int, default=1, help="rows that share a prompt (an RL group; the engine reads "
                   "a shared prompt's cache once for all its rows)")
    p.add_argument("--new-tokens", type=int, default=192, help="new tokens, forced")
    p.add_argument("--rank", type=int, default=32, help="LoRA rank on all seven projections")
    p.add_argument("--aqn-sigma", type=float, default=1e-2, help="AQN noise sigma on the norm weights")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows (the card, the versions) here")
    args = p.parse_args(argv)
    if args.samples < 1 or any(b < 1 or b % min(args.samples, b) for b in args.batches):
        p.error(f"--samples {args.samples} must be at least 1 and divide every batch of {args.batches} that it does "
                f"not exceed")
    if not torch.cuda.is_available():
        raise SystemExit("engine/bench_knockout.py times CUDA graphs: it needs a CUDA GPU")
    dev = torch.device("cuda")
    copy_tb_s = copy_bandwidth()
    model = random_model(qwen25_config(args.size), args.quant, dev, seed=0)
    _add_lora(model, args.rank)
    weights, kv = step_bytes(model), memory.kv_bytes_per_token(model.config, model.dtype, "model")
    prompts = lambda b: b // min(args.samples, b)  # (a shared prompt's columns are read once)
    floors = {b: floor_ms(weights, kv, prompts(b) * args.prompt_len + b * args.new_tokens / 2, copy_tb_s)
              for b in args.batches}
    print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; copy "
          f"{copy_tb_s:.2f} TB/s; Qwen2.5-{args.size} shape, {args.quant} + LoRA r{args.rank}, AQN sigma "
          f"{args.aqn_sigma:g}; prompt {args.prompt_len} ({args.samples} rows a prompt), {args.new_tokens} new tokens "
          f"forced", flush=True)
    def report(r):
        print(f"  {r['variant']}, round {r['round']}, {r['batch']} rows: {r['ms_step']:.3f} ms a step", flush=True)

    t0 = time.perf_counter()
    with aqn.noise(model, args.aqn_sigma, torch.Generator(dev).manual_seed(0)):
        rows = measure(model, args.batches, args.rounds, args.new_tokens, args.prompt_len, tuple(args.kinds),
                       args.samples, report)
    print(f"# {time.perf_counter() - t0:.0f} s")
    print(table(rows, floors))
    if args.json:
        write_json(args.json, dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                   triton=triton.__version__, copy_tb_s=copy_tb_s, args=vars(args), floors=floors,
                                   rows=rows))
    return rows


if __name__ == "__main__":
    main()
