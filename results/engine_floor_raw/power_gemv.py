"""Throwaway (results/engine_floor_h100.md, its last section): is the one-row NVFP4 GEMM held back by the card's
power limit? The plan's kernel for 7B gate|up and down at one row, cuBLAS bf16 on the same shapes and a 256 MB
device copy, each replayed back to back for a few seconds (a CUDA graph over rotated weight copies, so L2 holds
none of them) while nvidia-smi samples the board's power, SM clock and throttle reasons every 100 ms. An earlier
H200 run of the same kind (results/fp4_gemm_h200.md) found the kernel at that card's 700 W cap.

    PYTHONPATH=. python results/engine_floor_raw/power_gemv.py --json $OUT/power.json
"""
import argparse, json, subprocess, tempfile, time
import torch
from engine import plan as engine_plan
from engine.bench_gemm import QWEN7B_SHAPES, _layer_for, graph_of

p = argparse.ArgumentParser()
p.add_argument("--seconds", type=float, default=3.0)
p.add_argument("--json", default=None)
a = p.parse_args()


REASONS = next((f for f in ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
                if subprocess.run(["nvidia-smi", f"--query-gpu={f}", "--format=csv"], capture_output=True).returncode == 0),
               "clocks.mem")


def sampled(calls):
    """Replays graph_of(calls) for a.seconds while nvidia-smi samples; µs a call and the samples' means."""
    g, n = graph_of(calls), len(calls)
    g.replay()
    torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile("w+", suffix=".csv") as f:
        smi = subprocess.Popen(["nvidia-smi", f"--query-gpu=power.draw,clocks.sm,{REASONS}",
                                "--format=csv,noheader,nounits", "-lms", "100"], stdout=f)
        time.sleep(0.3)
        t0, reps = time.perf_counter(), 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        while time.perf_counter() - t0 < a.seconds:
            for _ in range(20):
                g.replay()
            reps += 20
            torch.cuda.synchronize()
        end.record()
        torch.cuda.synchronize()
        smi.terminate()
        smi.wait()
        f.seek(0)
        rows = [r.split(",") for r in f.read().split("\n") if r.count(",") == 2]
    rows = rows[3:-1] or rows  # (the samples around the start and the end left out)
    watts = [float(r[0]) for r in rows]
    mhz = [float(r[1]) for r in rows]
    reasons = sorted({r[2].strip() for r in rows})
    return dict(us=start.elapsed_time(end) * 1e3 / (reps * n), watts=sum(watts) / len(watts), watts_max=max(watts),
                sm_mhz=sum(mhz) / len(mhz), sm_mhz_min=min(mhz), throttle=reasons, samples=len(rows))


out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
for name in ("gate_up", "down"):
    layer = _layer_for(QWEN7B_SHAPES[name])
    x = torch.randn(1, layer.in_features, device="cuda", dtype=torch.bfloat16)
    gs = layer.weight_global_scale.float()
    copies = [(layer.weight_packed.clone(), layer.weight_scale.view(torch.uint8).clone()) for _ in range(4)]
    plan = engine_plan.plan_forward(1, layer.out_features, layer.in_features, x.dtype, x.device)
    ours = [lambda w=w, s=s: engine_plan.linear(x, w, s, gs, layer.bias, plan) for w, s in copies]
    out[f"{name} nvfp4 {plan}"] = sampled(ours)
    del copies, ours
    w = layer.dequantized_weight(torch.bfloat16)
    ws = [w.clone() for _ in range(3)]
    out[f"{name} cublas bf16"] = sampled([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
    del ws, w
    torch.cuda.empty_cache()
src = torch.empty(128 * 2**20, dtype=torch.bfloat16, device="cuda")
dst = torch.empty_like(src)
out["copy 256 MB (read + write)"] = sampled([lambda: dst.copy_(src)])
for k, v in out.items():
    print(k, v, flush=True)
if a.json:
    with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
