S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
PYTHONPATH=. timeout 100 /usr/local/cuda/bin/ncu -k regex:"_wgmma" $S python results/engine_floor_raw/ncu_gemm.py 64 > $OUT/ncu_gemm64.txt 2>&1
OMP_NUM_THREADS=1 timeout 200 python -m pytest -q -x -k "gpu_sampler_over or (gpu_wgmma_ws and bfloat16)" tests/engine/test_decode.py tests/engine/test_wgmma.py > $OUT/gpu_tests.txt 2>&1
tail -3 $OUT/gpu_tests.txt; grep -c Duration $OUT/ncu_gemm64.txt
