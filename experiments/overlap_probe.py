"""Could an RL step's update run beside its rollout's tail? A probe on a GPU, with stand-ins for both.

In an early-stopping rollout the longest completion sets the number of decode steps, and the steps at 2-8
live rows are ~40% of the decode (results/step_h100.md). Such a step reads every weight for a handful of
rows: its time is set by memory and latency, and the tensor cores sit nearly idle. The update is the
opposite, compute-bound GEMMs, and the groups whose completions have all finished could start theirs (the
trainer's weights do not change until the optimizer step). Whether that pays depends on one trade: how much
the decode slows down with GEMMs beside it, against how much GEMM work gets done meanwhile. This measures it:

- the decode: rollout.generate on the 7B shape, NVFP4 + LoRA r32, a few rows, lengths forced;
- the update's stand-in: bf16 GEMMs at a packed micro-batch's shape (8192 rows x gate|up), a CUDA graph
  replayed by a second thread on a stream of its own;
- each alone, then both at once, with the decode's stream at the same and at a higher priority.

"saved" is the GEMM work done during the overlapped decode (in seconds of GEMM alone) less the decode's
extra time, as a share of the decode alone: above 0, running the two together would shorten the step.
It is a stand-in: the real update also runs attention, elementwise kernels and host work.

    python experiments/overlap_probe.py [--rows 2 8] [--new-tokens 256]

What it found on an H100 (results/overlap_h100.md): beside GEMMs that hold every SM, each of a decode
step's launches waits for one to end, so a row count takes minutes and the answer is no.
"""
import argparse
import os
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules, not this folder's scripts

import torch  # noqa: E402

from engine.bench_rollout import _add_lora  # noqa: E402
from engine.decode import generate  # noqa: E402
from model import Transformer, qwen25_config  # noqa: E402
from rollout import release  # noqa: E402

GEMM = (8192, 3584, 37888)  # (rows, K, N): a packed micro-batch through gate|up
GEMMS_A_GRAPH = 8


class Background(threading.Thread):
    """Replays a graph of GEMMs on a low-priority stream until stopped, noting when each replay finished."""

    def __init__(self):
        super().__init__(daemon=True)
        M, K, N = GEMM
        self.stream = torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[0])
        self.done, self.stop = [], threading.Event()
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
        with torch.cuda.stream(self.stream):
            a @ w  # cuBLAS picks its kernel outside the capture
            self.stream.synchronize()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=self.stream):
                for _ in range(GEMMS_A_GRAPH):
                    a @ w
        self.flops = 2 * M * K * N * GEMMS_A_GRAPH  # a replay's

    def run(self):
        with torch.cuda.stream(self.stream):
            while not self.stop.is_set():
                self.graph.replay()
                self.stream.synchronize()
                self.done.append(time.perf_counter())

    def tflops(self, t0, t1):
        """GEMM throughput between t0 and t1 (replays that finished in it, over their span)."""
        inside = [t for t in self.done if t0 <= t <= t1]
        if len(inside) < 2:
            return 0.0
        return (len(inside) - 1) * self.flops / (inside[-1] - inside[0]) / 1e12


def decode(model, rows, new_tokens, stream):
    """ms a decode step of a forced-length rollout of `rows` rows on `stream`, and its start and end."""
    V = model.config.vocab_size
    prompts = torch.randint(0, V, (rows, 256), generator=torch.Generator().manual_seed(rows)).tolist()
    with torch.cuda.stream(stream):
        t0 = time.perf_counter()
        r = generate(model, prompts, max_new_tokens=new_tokens, stop_ids=(), seed=1)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
    return 1e3 * r.stats["decode_s"] / max(1, r.stats["steps"] - 1), t0, t1


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[2, 8], help="the decode's live rows")
    p.add_argument("--new-tokens", type=int, default=256, help="decode steps a measurement (forced)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("overlap_probe.py measures a GPU; none is here")
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; GEMM {GEMM} bf16", flush=True)
    model = Transformer.from_random(qwen25_config("7b"), torch.bfloat16, torch.device("cuda"), quantize=True, seed=0)
    _add_lora(model, 32)
    low, high = torch.cuda.Stream.priority_range()  # numerically: low priority first
    normal, urgent = torch.cuda.Stream(priority=low), torch.cuda.Stream(priority=high)  # for the decode
    bg = Background()
    bg.start()
    time.sleep(2.0)
    gemm_alone = bg.tflops(0, time.perf_counter())
    bg.stop.set()
    bg.join()
    print(f"GEMMs alone: {gemm_alone:.0f} TFLOP/s", flush=True)
    for rows in args.rows:
        decode(model, rows, args.new_tokens, normal)  # compiles and captures
        alone, _, _ = decode(model, rows, args.new_tokens, normal)
        for name, stream in (("same priority", normal), ("decode first", urgent)):
            bg = Background()
            bg.start()
            time.sleep(0.2)
            both, t0, t1 = decode(model, rows, args.new_tokens, stream)
            bg.stop.set()
            bg.join()
            frac = bg.tflops(t0, t1) / gemm_alone
            saved = (frac * both - (both - alone)) / alone
            print(f"rows {rows:2d}, {name:13s}: decode {alone:.2f} ms a step alone, {both:.2f} beside the GEMMs "
                  f"({both / alone:.2f}x); GEMMs at {frac:.0%} of alone; saved {saved:+.0%} of the decode", flush=True)
    release(model)


if __name__ == "__main__":
    main()
