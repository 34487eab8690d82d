#!/usr/bin/env bash
# Throwaway (results/engine_floor_h100.md, its last section): the warp-release probe's device call, as one script,
# steps in order of priority (the call's 600 s limit cuts the tail): the probe in its own patched copy of the tree
# (the kernels' A/B, its GPU tests, the decode steps' A/B), Nsight Compute's stalls of the 64-row gate|up kernel
# without and with it, then HEAD's GPU tests of the decode. Writes everything under $OUT. From the repository root:
#
#     OUT=/tmp/out bash results/engine_floor_raw/warp_release_call.sh
set -u
export PYTHONPATH=. OMP_NUM_THREADS=1
mkdir -p "$OUT" && OUT=$(realpath "$OUT")
NCU=/usr/local/cuda/bin/ncu
HEAD=$PWD
PROBE=/tmp/warp_release_probe
T0=$(date +%s)

# step NAME DIR SECONDS COMMAND...: run COMMAND in DIR under a timeout, its output to $OUT/NAME.txt
step() {
    local name=$1 dir=$2 limit=$3
    shift 3
    (cd "$dir" && timeout "$limit" "$@") > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "[t=$(( $(date +%s) - T0 ))s] $name: rc $rc" | tee -a "$OUT/log.txt"
}

# stalls NAME DIR: the 6th warp-specialized launch of ncu_gemm.py at 64 rows (gate|up's second), by SASS line
stalls() {
    step "$1" "$2" 60 $NCU -k regex:_wgmma_ws --launch-skip 5 --launch-count 1 --section SourceCounters \
        --section WarpStateStats -o "$OUT/$1" python results/engine_floor_raw/ncu_gemm.py 64
    $NCU -i "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1_sass.csv" 2>&1
    $NCU -i "$OUT/$1.ncu-rep" > "$OUT/$1_details.txt" 2>&1
}

{
    nvidia-smi --query-gpu=name,clocks.max.sm,power.limit,driver_version --format=csv
    python -c "import torch, triton, transformers as t; print(torch.__version__, triton.__version__, t.__version__)"
} > "$OUT/env.txt" 2>&1

rm -rf $PROBE && mkdir -p $PROBE
tar -c --exclude=./.git --exclude=./.venv . | tar -x -C $PROBE
step patch $PROBE 10 patch -p1 -i results/engine_floor_raw/warp_release.patch
step ws_release_ab $PROBE 110 python results/engine_floor_raw/ws_release_ab.py 32 64 256 1024 \
    --json "$OUT/ws_release_ab.json"
step probe_wgmma_tests $PROBE 100 env QERL_WARP_RELEASE=1 python -m pytest -q -x -k gpu tests/engine/test_wgmma.py
step warp_release_knob $PROBE 130 python results/engine_floor_raw/knob_ab.py plan.WARP_RELEASE 0 1 \
    --batches 64 32 8 --json "$OUT/warp_release_knob.json"
stalls ws64 "$HEAD"
QERL_WARP_RELEASE=1 stalls ws64_probe $PROBE
step gpu_tests_head "$HEAD" 150 python -m pytest -q -k gpu tests/engine/test_decode.py tests/test_rollout.py
