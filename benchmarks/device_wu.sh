#!/usr/bin/env bash
# Issue 12 goal 1, one nvidia-h200 call: GPU tests of the weight-update program (bytes == converter bytes, NaN/Inf
# refusal counted inside the quantize kernels, kept receiver), then the one-GPU update latency with per-kernel times.
#   cd .devwork/wu && bash benchmarks/device_wu.sh      (run tool, carry [".devwork/wu", ".wheels"])
set -uo pipefail
source benchmarks/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/wu
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_weight_update_gpu.py 2>&1 | tail -6 | tee $OUT/wu/log.txt
timeout ${WU_TIMEOUT:-200} python3 benchmarks/weight_update_gpu.py --kernels --out $OUT/wu/wu.json ${WU_ARGS:-} 2>&1 \
  | grep -v -i warn | grep -v "^ \|Ordered\|List reduced\|^$" | tee -a $OUT/wu/log.txt
# launch shapes: python3 benchmarks/segment_kernels_sweep.py (run 2026-12-01 09:11: amax 4 warps 310 vs 327 us, nvfp4 2x128 blocks 291 vs 305 us on a 30B-shaped fc1)
