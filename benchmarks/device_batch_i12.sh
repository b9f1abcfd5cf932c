#!/usr/bin/env bash
# Issue 12, one nvidia-h200 call (run tool, carry [".devwork/i12"], command: cd .devwork/i12 && bash
# benchmarks/device_batch_i12.sh): GPU tests of the weight-update program, its latency on one H200, FP8 GEMM probe.
set -uo pipefail
source benchmarks/device_setup.sh
OUT=${OUT:-/tmp/out}
LOG=$OUT/log.txt
nvidia-smi -L | tee -a $LOG
echo "== GPU tests: update program bytes == converter bytes; existing weight-update tests" | tee -a $LOG
timeout 140 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_weight_update_gpu.py 2>&1 | tail -25 | tee -a $LOG
timeout 110 python3 -m pytest -q -p no:cacheprovider tests/test_weight_update.py tests/test_engine_loop.py 2>&1 \
  | tail -4 | tee -a $LOG
echo "== weight update latency, one H200" | tee -a $LOG
timeout ${WU_TIMEOUT:-260} python3 benchmarks/weight_update_gpu.py --out $OUT/wu.json ${WU_ARGS:-} 2>&1 \
  | grep -v -i warn | tee -a $LOG
echo "== FP8 blockwise GEMM probe" | tee -a $LOG
timeout 50 python3 benchmarks/fp8_gemm_probe.py --out $OUT/fp8_probe.json 2>&1 | tail -8 | tee -a $LOG
