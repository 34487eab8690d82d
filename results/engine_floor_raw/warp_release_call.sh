#!/usr/bin/env bash
# Throwaway (results/engine_floor_h100.md, its last section): the warp-release probe's device call, as one script,
# steps in order of priority (the call's 600 s limit cuts the tail): the probe in its own patched copy of the tree
# (the kernels' A/B, its GPU tests, the decode steps' A/B), Nsight Compute's stalls of the 64-row gate|up kernel
# without and with it, then HEAD's GPU tests of the decode. Writes everything under $OUT. From the repository root:
#
#     OUT=/tmp/out bash results/engine_floor_raw/warp_release_call.sh
set -u
export PYTHONPATH=.
mkdir -p "$OUT" && OUT=$(realpath "$OUT")
NCU=/usr/local/cuda/bin/ncu
T0=$(date +%s)
el() { echo "[t=$(( $(date +%s) - T0 ))s] $*" | tee -a $OUT/log.txt; }
{ nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv; python -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)"; } > $OUT/env.txt 2>&1
el env
P=/tmp/probe; rm -rf $P; mkdir -p $P; tar -c --exclude=./.git --exclude=./.venv --exclude="*.ncu-rep" . | tar -x -C $P
(cd $P && patch -p1 < results/engine_floor_raw/warp_release.patch) > $OUT/patch.txt 2>&1
el patch rc $?
(cd $P && timeout 110 python results/engine_floor_raw/ws_release_ab.py 32 64 256 1024 --json $OUT/ws_release_ab.json) > $OUT/ws_release_ab.txt 2>&1
el ab rc $?
(cd $P && QERL_WARP_RELEASE=1 OMP_NUM_THREADS=1 timeout 100 python -m pytest -q -x -k gpu tests/engine/test_wgmma.py) > $OUT/probe_wgmma_tests.txt 2>&1
el probe tests rc $?
(cd $P && timeout 130 python results/engine_floor_raw/knob_ab.py plan.WARP_RELEASE 0 1 --batches 64 32 8 --json $OUT/warp_release_knob.json) > $OUT/warp_release_knob.txt 2>&1
el knob rc $?
timeout 60 $NCU -k regex:_wgmma_ws --launch-skip 5 --launch-count 1 --section SourceCounters --section WarpStateStats -o $OUT/ws64 python results/engine_floor_raw/ncu_gemm.py 64 > $OUT/ncu_run.txt 2>&1
el ncu rc $?
$NCU -i $OUT/ws64.ncu-rep --page source --csv --print-source sass > $OUT/ws64_sass.csv 2>&1; $NCU -i $OUT/ws64.ncu-rep > $OUT/ws64_details.txt 2>&1
(cd $P && QERL_WARP_RELEASE=1 timeout 60 $NCU -k regex:_wgmma_ws --launch-skip 5 --launch-count 1 --section SourceCounters --section WarpStateStats -o $OUT/ws64_probe python results/engine_floor_raw/ncu_gemm.py 64) > $OUT/ncu_probe_run.txt 2>&1
el ncu probe rc $?
$NCU -i $OUT/ws64_probe.ncu-rep --page source --csv --print-source sass > $OUT/ws64_probe_sass.csv 2>&1; $NCU -i $OUT/ws64_probe.ncu-rep > $OUT/ws64_probe_details.txt 2>&1
OMP_NUM_THREADS=1 timeout 150 python -m pytest -q -k gpu tests/engine/test_decode.py tests/test_rollout.py > $OUT/gpu_tests_head.txt 2>&1
el head tests rc $?
