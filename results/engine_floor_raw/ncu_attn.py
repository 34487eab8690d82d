"""Throwaway (results/engine_floor_h100.md, its last section): one eager decode step's attention kernels (split
and combine) at 32 or 64 rows, 8 rows a prompt, under Nsight Compute, to see what the split kernel waits on.
7B shape, NVFP4 + LoRA r32; prompt 256; the step 40 new tokens in (the kernels of earlier steps skipped).

    PYTHONPATH=. ncu -k regex:_attn_ --launch-skip 1120 --launch-count 4 --section SpeedOfLight --section Occupancy \
        --section LaunchStats --section WarpStateStats --section SchedulerStats \
        python results/engine_floor_raw/ncu_attn.py 64
"""
import sys
import torch
from engine import decode
from engine.bench_rollout import _add_lora, random_model
from model import qwen25_config

rows = int(sys.argv[1]) if len(sys.argv) > 1 else 64
dev = torch.device("cuda")
model = random_model(qwen25_config("7b"), "nvfp4", dev, seed=0)
_add_lora(model, 32)
V = model.config.vocab_size
prompts = torch.randint(0, V, (rows // 8, 256), generator=torch.Generator().manual_seed(rows)).tolist()
decode.generate(model, prompts, n=8, max_new_tokens=48, stop_ids=(), seed=5, graphs=False)
torch.cuda.synchronize()
