#!/usr/bin/env bash
# Issue 12 goal 1 on nvidia-h200-x2 (one call): GPU tests of the weight-update program, the two-process engine run,
# the NCCL update GPU0 -> GPU1 next to a bare NCCL broadcast of the same bytes, then the one-GPU figures again.
#   cd .devwork/wu && bash benchmarks/device_x2_wu.sh      (run tool, kind nvidia-h200-x2, carry [".devwork/wu", ".wheels"])
set -uo pipefail
source benchmarks/device_setup.sh
OUT=${OUT:-/tmp/out}; mkdir -p $OUT/wu; T0=$(date +%s)
nvidia-smi -L | tee $OUT/wu/log.txt; nvidia-smi topo -m 2>&1 | head -4 | tee -a $OUT/wu/log.txt
timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_weight_update_gpu.py tests/test_engine_remote.py \
  2>&1 | tail -4 | tee -a $OUT/wu/log.txt
echo "== NCCL [$(( $(date +%s) - T0 ))s]" | tee -a $OUT/wu/log.txt
timeout 200 python3 benchmarks/weight_update_nccl.py --out $OUT/wu/wu_nccl.json 2>&1 | grep -v -i warn | tee -a $OUT/wu/log.txt
echo "== one GPU [$(( $(date +%s) - T0 ))s]" | tee -a $OUT/wu/log.txt
timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/weight_update_gpu.py --out $OUT/wu/wu.json 2>&1 \
  | grep -v -i warn | grep -v "^ \|Ordered\|List reduced\|^$" | tee -a $OUT/wu/log.txt
echo "== done [$(( $(date +%s) - T0 ))s]"
