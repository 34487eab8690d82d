"""Throwaway (results/engine_floor_h100.md, its last section): where
the graphed decode step's time goes, kernel by kernel, from a CUPTI trace of its graph replays (torch.profiler):
per kernel group (engine.bench_rollout.kernel_group, the eager profile's groups; the attention's two kernels and
each GEMM by its grid apart), launches a step, mean duration and its share of the step (each covered instant
goes to the kernel running then that started first: see analyze), and the time no kernel runs
(engine.bench_step.gaps_between).
7B shape, NVFP4 + LoRA r32, AQN, prompt 256, forced length; 8 rows a prompt from 8. TL_SELFTEST=1 runs the
analysis on made-up kernels (on the CPU). If the trace holds no kernels, CUPTI did not report the graph's nodes.

    TL_SELFTEST=1 PYTHONPATH=. python results/engine_floor_raw/graph_timeline.py
    PYTHONPATH=. python results/engine_floor_raw/graph_timeline.py --batches 1 8 32 64 --json tl.json
"""
import argparse, collections, heapq, json, os, tempfile
import torch, triton
import aqn
from engine import decode
from engine.bench_rollout import ATTENTION, CUBLAS, FP4_GEMM, _add_lora, kernel_group, random_model
from engine.bench_step import gaps_between
from model import qwen25_config
from rollout import release

p = argparse.ArgumentParser()
p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
p.add_argument("--new-tokens", type=int, default=48)
p.add_argument("--quant", default="nvfp4")
p.add_argument("--json", default=None)
a = p.parse_args()


def kind(e):
    """A kernel's row in the table: its profile group, the attention's two kernels apart, and each fp4 GEMM
    by its grid (q|k|v, o, gate|up and down launch different grids), with its registers a thread."""
    n, g = e["name"], kernel_group(e["name"])
    if g == ATTENTION:
        return g + (": combine" if "combine" in n else ": partial")
    if g == FP4_GEMM:
        return f"{g} {n.split('(')[0][:16]} grid {tuple(e['args'].get('grid', ()))} regs {e['args'].get('registers per thread')}"
    return g


def analyze(ev, label):
    """Over the steps in the middle of the trace: per kind, launches a step, mean duration and its share of the
    step: each instant that some kernel covers, on any stream, goes to the one of them that started first (a
    kernel launched early by PDL, or beside a longer one on the second stream, costs only what it adds past
    the others), so the shares and the idle time add up to the step."""
    if not ev:
        print(f"{label}: no kernels traced", flush=True)
        return None
    ends = sorted(e["ts"] + e["dur"] for e in ev if "_sample_final_kernel" in e["name"])  # one a step
    streams = collections.Counter(e["args"].get("stream") for e in ev)
    print(f"{label}: {len(ev)} kernels traced on {len(streams)} streams, {len(ends)} sampler ends", flush=True)
    if len(ends) < 12:
        return None
    lo, hi = ends[len(ends) // 3], ends[-4]  # steps in the middle: (lo, hi]
    steps = sum(1 for t in ends if lo < t <= hi)
    agg = collections.defaultdict(lambda: [0, 0.0, 0.0])  # launches, duration, share
    inside = [e for e in ev if lo < e["ts"] + e["dur"] <= hi]
    for e in inside:
        agg[kind(e)][0] += 1
        agg[kind(e)][1] += e["dur"]
    # sweep the boundaries; `live` holds (start, index) of the kernels running, the earliest first
    marks = sorted([(max(e["ts"], lo), 1, i) for i, e in enumerate(ev) if e["ts"] + e["dur"] > lo and e["ts"] < hi] +
                   [(min(e["ts"] + e["dur"], hi), 0, i) for i, e in enumerate(ev) if e["ts"] + e["dur"] > lo and e["ts"] < hi])
    live, gone, t0 = [], set(), lo
    for t, starts, i in marks:
        while live and live[0][1] in gone:
            heapq.heappop(live)
        if live and t > t0:
            agg[kind(ev[live[0][1]])][2] += t - t0
        t0 = t
        if starts:
            heapq.heappush(live, (ev[i]["ts"], i))
        else:
            gone.add(i)
    # idle: what no kernel covers in (lo, hi], the stretch from lo to the first kernel's start included
    spans = [(max(e["ts"], lo), min(e["ts"] + e["dur"], hi), e["name"]) for e in ev
             if e["ts"] + e["dur"] > lo and e["ts"] < hi]
    idle_us = 1e6 * sum(g for g, _, _ in gaps_between(spans)) + min(a for a, _, _ in spans) - lo
    step_us = (hi - lo) / steps
    idle = idle_us / steps
    print(f"  step {step_us:.1f} us over {steps} steps; GPU idle {idle:.1f} us a step")
    print("  | kernel | launches a step | mean us | us a step | share of the step, us |")
    rows = []
    for k, (c, d, inc) in sorted(agg.items(), key=lambda kv: -kv[1][2]):
        rows.append(dict(kernel=k, per_step=c / steps, mean_us=d / max(c, 1), us_step=d / steps, inc_us_step=inc / steps))
        print(f"  | {k} | {c / steps:.1f} | {d / max(c, 1):.2f} | {d / steps:.1f} | {inc / steps:.1f} |")
    print(f"  shares and idle add up to {sum(r['inc_us_step'] for r in rows) + idle:.1f} us a step", flush=True)
    return dict(step_us=step_us, idle_us=idle, steps=steps, rows=rows)


out = {}
if os.environ.get("TL_SELFTEST"):  # the analysis on made-up kernels: 20 steps of 3 main kernels and one beside
    ev, t = [], 0.0
    for i in range(20):
        ev.append(dict(name="_wgmma_kernel", ts=t, dur=10.0, args=dict(stream=7)))
        ev.append(dict(name="sm90_gemm", ts=t + 1, dur=4.0, args=dict(stream=9)))
        ev.append(dict(name="_attn_partial_kernel", ts=t + 8, dur=5.0, args=dict(stream=7)))  # overlaps (PDL)
        ev.append(dict(name="_sample_final_kernel", ts=t + 15, dur=3.0, args=dict(stream=7)))  # 2 us idle before, 2 after
        t += 20.0
    r = analyze(ev, "selftest")
    assert abs(r["step_us"] - 20) < 1e-9 and abs(r["idle_us"] - 4) < 1e-9, r
    inc = {x["kernel"]: x["inc_us_step"] for x in r["rows"]}
    assert inc == {FP4_GEMM + " _wgmma_kernel grid () regs None": 10.0, ATTENTION + ": partial": 3.0, "sampler": 3.0,
                   CUBLAS: 0.0}, inc
    raise SystemExit("selftest passed")
dev = torch.device("cuda")
model = random_model(qwen25_config("7b"), a.quant, dev, seed=0)
_add_lora(model, 32)
V = model.config.vocab_size
print(f"# {torch.cuda.get_device_name()}; torch {torch.__version__}, triton {triton.__version__}; 7b {a.quant} + LoRA r32, "
      f"AQN 1e-2; prompt 256, {a.new_tokens} new tokens forced; 8 rows a prompt from 8 rows", flush=True)
with aqn.noise(model, 1e-2, torch.Generator(dev).manual_seed(0)):
    for b in a.batches:
        release(model)
        n = 8 if b >= 8 else 1
        prompts = torch.randint(0, V, (b // n, 256), generator=torch.Generator().manual_seed(b)).tolist()
        kw = dict(n=n, max_new_tokens=a.new_tokens, stop_ids=(), seed=5)
        decode.generate(model, prompts, **kw)  # compile + capture
        st = decode.generate(model, prompts, **kw).stats
        plain_us = 1e6 * st["decode_s"] / max(1, st["steps"] - 1)
        print(f"{b} rows: {plain_us:.1f} us a step untraced", flush=True)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            decode.generate(model, prompts, **kw)
            torch.cuda.synchronize()
        path = os.path.join(tempfile.gettempdir(), f"tl_{b}.json")
        prof.export_chrome_trace(path)
        ev = [e for e in json.load(open(path))["traceEvents"] if e.get("cat") == "kernel"]
        res = analyze(ev, f"{b} rows")
        if res is None:
            continue
        out[b] = dict(res, plain_us=plain_us)
if a.json:
    json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                   args=vars(a), batches=out), open(a.json, "w"), indent=1)
