"""Benchmark and tuning of the W4A16 kernels on a GPU, against cuBLAS bf16 on the same shapes.

    python -m engine.bench_gemm --bench     # the plan's kernel per shape vs cuBLAS bf16 (markdown table)
    python -m engine.bench_gemm --tune      # every candidate config per shape; the best ones
    python -m engine.bench_gemm --tune --size 32b --m 1 --no-dx   # another size's shapes
    (python fp4_gemm.py --bench passes through to this.)

Measures: engine/plan.py's choice (--bench) or every config `_candidates` lists (--tune) on Qwen2.5-7B's
linear shapes (--size: another Qwen2.5 size's), each checked against a float reference first, timed as
CUDA-graph replays over rotated weight copies (so L2 holds none of them), beside cuBLAS bf16 and the
device-copy bandwidth of the same run. Each row's floor is the bytes it must move (packed weight and
scales, x and y; cuBLAS: the bf16 weight, x and y) at that copy bandwidth, and its share is floor / time
(floor_shares). --json PATH writes the rows with their floors; --out DIR the table (.md) and every row
tried (.jsonl). The plan's table was read off --tune; the tables it printed are in
results/fp4_gemm_h200.md.
"""
import argparse
import json
import math
import os

import torch
import torch.nn as nn
import triton

from engine import plan as engine_plan
from engine.plan import _last_wave_split, _wgmma_rows_of_x, _ws_ring_bytes, plan_dx, plan_forward
from fp4_backend import KERNELS
from fp4_gemm import QuantLinear
from hub import write_text
from model import qwen25_config

SIZES = ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b")  # the Qwen2.5 sizes model.qwen25_config knows


def layer_shapes(size):
    """A Qwen2.5 size's linears as the decode fuses them: name → (in_features, out_features of the layers
    fused into one matmul, bias). From model.qwen25_config (the published configs)."""
    cfg = qwen25_config(size)
    H, I, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"qkv": (H, (q, kv, kv), True), "o": (q, (H,), False), "gate_up": (H, (I, I), False),
            "down": (I, (H,), False)}


QWEN7B_SHAPES = layer_shapes("7b")  # the default: the shapes the plan's table was read off
BENCH_M = (1, 4, 16, 64, 256, 1024, 4096)
ROTATE_BYTES = 256 * 2**20  # weights touched per timed graph: several times the 50 MB L2


def _bench_layer(K, parts, bias, seed=0):
    """A random Qwen-like layer on the GPU, quantized part by part and fused (per-row global scales)."""
    torch.manual_seed(seed)
    layers = []
    for n in parts:
        lin = nn.Linear(K, n, bias=bias, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            lin.weight.normal_(0, 0.02)
            if bias:
                lin.bias.normal_(0, 0.1)
        layers.append(QuantLinear.from_linear(lin))
    return QuantLinear.concat(layers) if len(layers) > 1 else layers[0]


def graph_of(calls):
    """The calls back to back in one CUDA graph (no launch gaps), run once first outside it (compile, warm-up)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph


def _graph_ms(calls):
    """Median ms per call: graph_of(calls) replayed by triton.testing.do_bench (which also flushes L2
    between replays)."""
    graph = graph_of(calls)
    ms = triton.testing.do_bench(graph.replay, warmup=5, rep=25, return_mode="median")
    del graph
    return ms / len(calls)


def _copies(nbytes):
    return max(1, math.ceil(ROTATE_BYTES / nbytes))


def _ours_calls(layer, M, plan, direction, x):
    """Closures launching our kernel on rotated copies of the weight."""
    wbytes = layer.weight_packed.numel() + layer.weight_scale.numel()
    calls = []
    for _ in range(_copies(wbytes)):
        p, s = layer.weight_packed.clone(), layer.weight_scale.view(torch.uint8).clone()
        gs, b = layer.weight_global_scale.float(), layer.bias
        if direction == "fwd":
            calls.append(lambda p=p, s=s: engine_plan.linear(x, p, s, gs, b, plan))
        else:
            calls.append(lambda p=p, s=s: engine_plan.dx(x, p, s, gs, plan))
    return calls


def _cublas_calls(layer, direction, x):
    w = layer.dequantized_weight(torch.bfloat16)  # (N, K)
    b = layer.bias
    calls = []
    for _ in range(_copies(w.numel() * 2)):
        wc = w.clone()
        if direction == "fwd":
            calls.append(lambda wc=wc: torch.nn.functional.linear(x, wc, b))
        else:
            calls.append(lambda wc=wc: x @ wc)
    return calls


def _rel_err(y, ref):
    return ((y.float() - ref).norm() / ref.norm()).item()


def _reference(layer, x, direction):
    w = layer.dequantized_weight(torch.float32)
    if direction == "fwd":
        y = x.float() @ w.t()
        return y + layer.bias.float() if layer.bias is not None else y
    return x.float() @ w


def _candidates(M, N, K, direction):
    """Launch configs worth timing for one problem (what --tune sweeps; plan_forward holds the winners)."""
    dq = [dict(kernel="dequant", DQ=c) for c in ((16, 256, 4), (16, 512, 4), (32, 512, 8), (8, 512, 4))]
    if direction == "dx":
        return dq + [dict(kernel="tiled", BLOCK_M=128, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=8, num_stages=3)]
    c = []
    if M <= 8:
        for rt, w in ((1, 4), (1, 8), (2, 4)):
            for split in (1, 2, 4, 8, 16):
                c.append(dict(kernel="mma", ROW_TILES=rt, num_warps=w, SPLIT_K=split))
    if M == 1:
        for bn, bk, w in ((8, 512, 4), (8, 256, 2), (16, 512, 4), (32, 512, 4)):
            for split in (1, 2, 4):
                if split == 1 or triton.cdiv(N, bn) * split <= 1800:
                    c.append(dict(kernel="gemv", BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=split, num_warps=w, num_stages=1))
    if 1 < M <= 256:
        for bt in [_wgmma_rows_of_x(min(M, 64), N, K)] + ([128] if M > 64 else []):
            for bk in (128, 256):
                if K % bk == 0:
                    for split in (1, 2, 4, 8, 16):
                        c.append(dict(kernel="wgmma", BT=bt, BLOCK_K=bk, SPLIT_K=split))
    # the warp-specialized wgmma: rings of 2 to 4 stages, one to three consumer warpgroups (not at 1-8 rows,
    # where it lost to the mma kernel and to the plain wgmma kernel: results/fp4_gemm_h200.md)
    if K % 256 == 0 and 8 < M <= 256:
        for bt in [_wgmma_rows_of_x(min(M, 64), N, K)] + ([128] if M > 64 else []):
            for nwg in (1, 2, 3):
                for stages in (2, 3, 4):
                    tiles = dict(kernel="wgmma", BT=bt, BLOCK_K=256, STAGES=stages, NWG=nwg)
                    if _ws_ring_bytes(tiles) <= 220 * 1024:
                        c += [dict(tiles, SPLIT_K=s) for s in (1, 2, 3, 4, 8) + ((16,) if K >= 8192 else ())]
                        last = _last_wave_split(tiles, M, N, K, torch.device("cuda"))  # (its own SPLIT_K)
                        c += [dict(tiles, **last)] if last else []
    if K % 256 == 0 and M > 64:  # the persistent variant (unsplit, two or three consumer warpgroups), with
        # stream-K or not
        c += [dict(kernel="wgmma", BT=128, BLOCK_K=256, SPLIT_K=1, STAGES=2, NWG=nwg, PERSIST=True, GROUP_M=g, **s)
              for nwg in (2, 3) for g in (4, 8, 16) for s in ({}, dict(STREAM=True))]
    if 16 < M <= 64:
        for bm in (32, 64) if M <= 32 else (64,):
            for bn in (32, 64, 128):
                for split in (1, 2, 4, 8):
                    c.append(dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, SPLIT_K=split,
                                  num_warps=4, num_stages=3))
    if 1 < M <= 32:
        for bn, bk, st, splits in ((32, 256, 4, (1, 4)), (64, 256, 3, (1, 2)), (64, 128, 4, (1, 2, 4)),
                                   (128, 128, 4, (4,))):
            for split in splits:
                c.append(dict(kernel="tiled", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split,
                              num_warps=4, num_stages=st))
    if 32 < M <= 512:
        for bm, bn, bk, w, st in ((64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (64, 128, 64, 4, 4), (128, 128, 64, 8, 3)):
            if bm <= max(64, M // 2):
                for split in (1, 2):
                    if split == 1 or triton.cdiv(M, bm) * triton.cdiv(N, bn) < 132:
                        c.append(dict(kernel="tiled", BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, SPLIT_K=split,
                                      num_warps=w, num_stages=st))
    if M >= 128:
        c += dq
    if M > 512:
        c.append(dict(kernel="tiled", BLOCK_M=256, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, SPLIT_K=1, num_warps=8,
                      num_stages=3))
    return c


def _problems(shapes, ms, with_dx=True):
    """(name, shape, M, direction) of every problem: each layer of `shapes` forward at every M of ms, then its
    dX at 4096 rows."""
    for M in ms:
        for name, shape in shapes.items():
            yield name, shape, M, "fwd"
    if with_dx:
        for name, shape in shapes.items():
            yield name, shape, 4096, "dx"


_LAYERS = {}


def _layer_for(shape):
    """The random quantized layer of `shape` (in_features, parts, bias), built once per process."""
    if shape not in _LAYERS:
        _LAYERS[shape] = _bench_layer(*shape, seed=len(_LAYERS))
    return _LAYERS[shape]


def _run_one(shape, M, direction, plan, x=None):
    layer = _layer_for(shape)
    K, N = layer.in_features, layer.out_features
    if x is None:
        x = torch.randn(M, N if direction == "dx" else K, device="cuda", dtype=torch.bfloat16)
    args = (layer.weight_packed, layer.weight_scale.view(torch.uint8), layer.weight_global_scale.float())
    if direction == "fwd":
        return engine_plan.linear(x, *args, layer.bias, plan)
    return engine_plan.dx(x, *args, plan)


def _warm(task):
    """Worker: compile one config by running it once (fills Triton's on-disk cache)."""
    name, shape, M, direction, plan = task
    try:
        _run_one(shape, M, direction, plan)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # reported by the parent
        return f"{name} M={M} {direction} {plan}: {type(e).__name__}: {str(e)[:300]}"


def _precompile(tasks, jobs):
    """Compile many configs in parallel processes before timing them one by one."""
    import concurrent.futures
    import multiprocessing

    errors = []
    if jobs <= 1:
        return [e for e in map(_warm, tasks) if e]
    ctx = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
        for err in pool.map(_warm, tasks, chunksize=max(1, len(tasks) // (4 * jobs))):
            if err:
                errors.append(err)
    return errors


def copy_bandwidth():
    """This GPU's device-to-device copy rate, TB/s of bytes read + written (1 GiB copied, median time)."""
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), warmup=10, rep=50, return_mode="median")
    return 2 * a.numel() / ms / 1e9  # TB/s, bytes read + written


def write_json(path, obj):
    """obj as indented JSON at path (atomically); what JSON cannot hold (a float nan) becomes null."""
    def clean(x):
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        if isinstance(x, float) and x != x:
            return None
        if isinstance(x, torch.Tensor):
            return clean(x.tolist())
        return x
    write_text(path, json.dumps(clean(obj), indent=1) + "\n")


def _measure(name, shape, M, direction, plans, log):
    """Check every plan against the float reference, time it and cuBLAS; returns result rows."""
    layer = _layer_for(shape)
    K, N = layer.in_features, layer.out_features
    x = torch.randn(M, N if direction == "dx" else K, device="cuda", dtype=torch.bfloat16)
    ref = _reference(layer, x, direction)
    out_dim = K if direction == "dx" else N
    nbytes = layer.weight_packed.numel() + layer.weight_scale.numel() + 2 * x.numel() + 2 * M * out_dim
    flops = 2 * M * N * K
    cublas = _cublas_calls(layer, direction, x)
    t_cublas = _graph_ms(cublas)
    err_cublas = _rel_err(cublas[0](), ref)
    rows = []
    for plan in plans:
        try:
            err = _rel_err(_run_one(shape, M, direction, plan, x), ref)
            t = _graph_ms(_ours_calls(layer, M, plan, direction, x)) if err < 2e-2 else float("nan")
        except Exception as e:
            log(f"  FAILED {name} M={M} {direction} {plan}: {type(e).__name__}: {str(e)[:300]}")
            continue
        rows.append(dict(shape=name, M=M, N=N, K=K, direction=direction, plan=plan, ms=t, err=err,
                         cublas_ms=t_cublas, cublas_err=err_cublas, tbps=nbytes / t / 1e9, tflops=flops / t / 1e9,
                         ratio=t_cublas / t))
    return rows


def json_rows(rows, copy_tbps):
    """The rows as written by --json: each with its kernel label, floor µs and shares (floor_shares)."""
    out = []
    for r in rows:
        floor_us, share, cublas_share = floor_shares(r, copy_tbps)
        out.append(dict(r, kernel=_kernel_label(r["plan"]), floor_us=floor_us, share=share, cublas_share=cublas_share))
    return out


def _kernel_label(p):
    """A plan as the table's kernel column: 'mma 64 rows split4 w4', 'tiled 16x64x128 split4 w4s4', ..."""
    split = f" split{p['SPLIT_K']}" if p.get("SPLIT_K", 1) > 1 else ""
    split += f" after {p['WHOLE']} whole" if p.get("WHOLE") else ""
    if p["kernel"] == "dequant":
        return "dequant+cuBLAS" + (" {}x{} w{}".format(*p["DQ"]) if p.get("DQ") else "")
    if p["kernel"] == "mma":
        return f"mma {16 * p['num_warps'] * p['ROW_TILES']} rows{split} w{p['num_warps']}"
    if p["kernel"] == "wgmma":
        ws = f" ws{p['STAGES']}" + (f"x{p['NWG']}wg" if p.get("NWG", 1) > 1 else "") if "STAGES" in p else ""
        ws += f" persistent g{p['GROUP_M']}" + (" stream-K" if p.get("STREAM") else "") if p.get("PERSIST") else ""
        return f"wgmma {64 * p.get('NWG', 1)}x{p['BT']}x{p['BLOCK_K']}{split}{ws}"
    return (f"{p['kernel']} {p.get('BLOCK_M', 1)}x{p['BLOCK_N']}x{p['BLOCK_K']}{split}"
            + (" plain-decode" if p.get("asm") is False else "") + f" w{p.get('num_warps')}s{p.get('num_stages')}")


def floor_shares(r, copy_tbps):
    """A row's floor at the copy bandwidth: (floor µs, our share = floor / our time, cuBLAS's share of its own
    floor). Ours moves its TB/s column's bytes (packed weight + scales + x + y); cuBLAS bf16 moves a 2-byte
    weight, x and y (for dX: x (M, N) in, (M, K) out: the same sum)."""
    floor_us = r["ms"] * 1e3 * r["tbps"] / copy_tbps  # (tbps = our bytes / our time)
    cublas_bytes = 2 * (r["N"] * r["K"] + r["M"] * r["K"] + r["M"] * r["N"])
    return floor_us, r["tbps"] / copy_tbps, cublas_bytes / (copy_tbps * 1e12) / (r["cublas_ms"] / 1e3)


def _table(rows, copy_tbps, device=None):
    lines = [f"Device: {device or torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
             f"device copy {copy_tbps:.2f} TB/s (read + write). Times: median of CUDA-graph replays over rotated "
             f"weight copies (≥ {ROTATE_BYTES >> 20} MiB a replay, L2 flushed between replays). TB/s counts packed "
             "weight + scales + x + y bytes; ratio = cuBLAS bf16 time / ours (> 1: we are faster); floor = those bytes "
             "at the copy bandwidth, share = floor / time (cuBLAS: of its bf16 bytes' floor).", "",
             "| layer | N x K | M | pass | kernel | ours µs | cuBLAS µs | ratio | TB/s | floor µs | share | cuBLAS share "
             "| TFLOP/s | rel err (ours / cuBLAS) |",
             "| --- | --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        floor_us, share, cublas_share = floor_shares(r, copy_tbps)
        lines.append(f"| {r['shape']} | {r['N']} x {r['K']} | {r['M']} | {r['direction']} | {_kernel_label(r['plan'])} | "
                     f"{r['ms'] * 1e3:.1f} | {r['cublas_ms'] * 1e3:.1f} | {r['ratio']:.2f} | {r['tbps']:.2f} | "
                     f"{floor_us:.1f} | {share:.0%} | {cublas_share:.0%} | "
                     f"{r['tflops']:.0f} | {r['err']:.1e} / {r['cublas_err']:.1e} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description="NVFP4 W4A16 kernels: benchmark against cuBLAS bf16 on "
                                                 "Qwen2.5-7B's layer shapes, or sweep launch configs.")
    parser.add_argument("--bench", action="store_true", help="time the per-shape table's choice vs cuBLAS bf16 and "
                                                             "print a markdown table")
    parser.add_argument("--tune", action="store_true", help="time every candidate config per problem; print the best")
    parser.add_argument("--m", type=int, nargs="*", default=list(BENCH_M), help="batch sizes (rows of x) to run")
    parser.add_argument("--size", default="7b", choices=SIZES, help="the Qwen2.5 size whose layer shapes to run")
    parser.add_argument("--shapes", nargs="*", default=list(QWEN7B_SHAPES), help="layers to run")
    parser.add_argument("--no-dx", action="store_true", help="skip the dX backward at M=4096")
    parser.add_argument("--kernel", choices=[k for k in KERNELS if k], help="--tune: only this kernel's configs")
    parser.add_argument("--jobs", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)),
                        help="processes compiling kernels in parallel before timing")
    parser.add_argument("--out", default=None, help="also write the table (.md) and all rows (.jsonl) here")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the table's rows, each with its "
                        "floor and shares, the card and the versions, as JSON here")
    args = parser.parse_args()
    if not (args.bench or args.tune):
        parser.error("nothing to do: pass --bench or --tune")
    if not torch.cuda.is_available():
        raise SystemExit("--bench/--tune need a CUDA GPU and triton")
    import time

    t0 = time.time()
    log = lambda s: print(s, flush=True)
    probs = [p for p in _problems(layer_shapes(args.size), args.m, not args.no_dx) if p[0] in args.shapes]
    plans = {}
    for name, shape, M, d in probs:
        K, N = shape[0], sum(shape[1])
        dev = torch.device("cuda")
        chosen = plan_forward(M, N, K, torch.bfloat16, dev) if d == "fwd" else plan_dx(M, N, K, torch.bfloat16, dev)
        plans[(name, shape, M, d)] = ([p for p in _candidates(M, N, K, d) if args.kernel in (None, p["kernel"])]
                                      if args.tune else [chosen])
    tasks = [(*problem, p) for problem, ps in plans.items() for p in ps if p["kernel"] != "dequant"]
    log(f"{len(probs)} problems (Qwen2.5-{args.size} shapes), {len(tasks)} kernel launches to compile on "
        f"{args.jobs} processes")
    for e in _precompile(tasks, args.jobs):
        log("  compile/run error: " + e)
    log(f"compiled in {time.time() - t0:.0f} s")
    copy = copy_bandwidth()
    log(f"device copy bandwidth: {copy:.2f} TB/s")
    rows, best = [], []
    jsonl = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        jsonl = open(os.path.join(args.out, f"fp4_gemm_{'tune' if args.tune else 'bench'}.jsonl"), "w")
    for (name, shape, M, d), ps in plans.items():
        r = _measure(name, shape, M, d, ps, log)
        rows += r
        if jsonl:  # written as we go: a run cut short still leaves its numbers
            for x in r:
                jsonl.write(json.dumps(x) + "\n")
            jsonl.flush()
        ok = [x for x in r if x["ms"] == x["ms"]]
        if ok:
            b = min(ok, key=lambda x: x["ms"])
            best.append(b)
            log(f"{name:8s} M={M:5d} {d}: best {b['ms'] * 1e3:8.1f} us  cuBLAS {b['cublas_ms'] * 1e3:8.1f} us  "
                f"ratio {b['ratio']:.2f}  {b['tbps']:.2f} TB/s  err {b['err']:.1e}  {b['plan']}")
            if args.tune:
                for x in sorted(ok, key=lambda x: x["ms"])[:6]:
                    log(f"      {x['ms'] * 1e3:8.1f} us  {x['plan']}")
    table = _table(best, copy)
    print(table)
    log(f"total {time.time() - t0:.0f} s")
    if args.json:
        write_json(args.json, dict(device=torch.cuda.get_device_name(), size=args.size, torch=torch.__version__,
                                   triton=triton.__version__, copy_tb_s=copy, rows=json_rows(best, copy)))
    if args.out:
        jsonl.close()
        with open(os.path.join(args.out, f"fp4_gemm_{'tune' if args.tune else 'bench'}.md"), "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
