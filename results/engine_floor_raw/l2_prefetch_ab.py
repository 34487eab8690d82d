"""Throwaway: the decode step with and without the L2 prefetch, alternating in one process."""
import json, os, sys, time
import torch
import aqn
from engine import prefetch
from engine.bench_rollout import random_model, _add_lora, _bench_one, step_bytes, floor_ms
from engine.bench_gemm import copy_bandwidth
from model import qwen25_config
import memory
from rollout import release
from engine import decode

_silu = decode.Decoder.silu_mul
MODE = {"v": "both"}
def silu_mul(self, gu, a, grp, order=decode.NATURAL, prefetch=None):  # "o": the next q|k|v not prefetched
    return _silu(self, gu, a, grp, order, prefetch if MODE["v"] == "both" else None)
decode.Decoder.silu_mul = silu_mul

out = sys.argv[1]; quants = sys.argv[2].split(","); rounds = int(sys.argv[3]); deadline = time.time() + float(sys.argv[4])
dev = torch.device("cuda")
bw = copy_bandwidth()
res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, copy_tb_s=bw, rows=[])
print("copy", bw, flush=True)
for quant in quants:
    model = random_model(qwen25_config("7b"), quant, dev, seed=0)
    _add_lora(model, 32)
    w = step_bytes(model); kv = memory.kv_bytes_per_token(model.config, model.dtype, "model")
    with aqn.noise(model, 1e-2, torch.Generator(dev).manual_seed(0)):
        for rnd in range(rounds):
            modes = ["both", "off", "o"] if quant == "nvfp4" else ["both", "off"]
            for on in (modes if rnd % 2 == 0 else modes[::-1]):
                prefetch.ENABLED = on != "off"
                MODE["v"] = on
                release(model)
                for b in (1, 8, 64):
                    if time.time() > deadline:
                        break
                    r = _bench_one(model, b, 256, 256, seed=b)
                    fl = floor_ms(w, kv, b * (256 + 128), bw)
                    row = dict(quant=quant, round=rnd, prefetch=on, batch=b, ms_step=r["ms_step"], floor_ms=fl,
                               share=fl / r["ms_step"], capture_s=r["capture_s"])
                    res["rows"].append(row); print(row, flush=True)
                    json.dump(res, open(out, "w"), indent=1)
    release(model); del model; torch.cuda.empty_cache()
