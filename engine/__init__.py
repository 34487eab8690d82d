"""The engine room: what makes the idea files fast on a GPU, one topic a file, each tested against the
idea-file function it speeds up (tests/engine/). fp4_gemm.py, rollout.py and model.py each reach it at one
dispatch point, and only on a GPU (or for a kernel a test pins, or inside fp4_gemm.fp8_tensor_cores).
It takes from them only public names: from fp4_gemm.py the Triton pieces its kernels share (decode_plain,
e4m3_to_f32, e2m1_to_f32, w_pairs, scale_bias, finish_tile), the tiled launches (tiled_linear, tiled_dx,
splitk_reduce), check_operands, torch_linear, dequantize, QuantLinear; from fp4_backend.py the choice of
path (uses_triton, pinned_kernel, KERNELS) and the launch helpers (launchable, launch_opts, split_k, k_chunk).

ptx.py         the E2M1/E4M3 decode as inline PTX, and a warp-wide emulator of it for CPU tests
pdl.py         programmatic dependent launch: a kernel scheduled while the one before finishes
mma.py         decode's kernels for 1-8 rows of x: the mma.sync tensor-core GEMV, the fp32 GEMV
wgmma.py       Hopper's wgmma kernels (Gluon): warp-specialized, persistent, stream-K
korder.py      x in the wgmma kernels' K order, and the API for callers that store x that way
plan.py        which kernel serves which shape (a fixed table), dequant + cuBLAS, the launches
side.py        a small dense product (decode's LoRA A's) riding along in the GEMM's launch
fp8.py         the update's GEMMs on FP8 tensor cores: an option that changes the numbers (--fp8-update)
varlen.py      the update's shared-prompt attention without padding (torch's variable-length flash attention)
bench_gemm.py  python -m engine.bench_gemm --bench | --tune: the kernels against cuBLAS bf16

decode.py          the decode engine behind rollout.generate on a GPU (one CUDA graph a step)
decode_kernels.py  its fused Triton kernels: the small ops between a decode step's GEMMs
bench_rollout.py   the decode engine's tokens/s, NVFP4 + LoRA against bf16 + LoRA
bench_knockout.py  what each kind of small kernel costs the graphed decode step (the step without it)
bench_step.py      full RL steps on one GPU, 16-bit LoRA against NVFP4 LoRA
"""
