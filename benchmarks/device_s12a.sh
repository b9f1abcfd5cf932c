#!/usr/bin/env bash
# Session 12, call 1: the GPU tests of session 11's unmeasured mends (stop on failure), the fused-op probe, and
# per-phase profiles of bf16 vs fp8-blockwise-hopper on moe-h3072 (the final session-11 tree). Writes $OUT/s12a/.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/s12a; T0=$(date +%s); L=$OUT/s12a/log.txt
timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu --tb=short tests/test_engine_fastgemm.py \
  tests/test_engine_rollout.py tests/test_rollout_gpu.py tests/test_engine_loop.py > /tmp/pt.log 2>&1; rc=$?
tail -c 4000 /tmp/pt.log >> $L; tail -c 1500 /tmp/pt.log | grep -E "passed|failed|Error|FAILED" | tail -8
[ $rc -ne 0 ] && { echo "GPU tests rc=$rc: stopping"; tail -c 2500 /tmp/pt.log; exit 1; }
timeout 60 python3 -m pytest -q -p no:cacheprovider --tb=short tests/test_kernels.py -k padded_col_and_rowcol 2>&1 \
  | tail -3 | tee -a $L
echo "== probe [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 150 python3 benchmarks/fused_ops_probe.py --out $OUT/s12a/fused_ops.json 2>&1 | tee -a $L | grep -v "^    "
echo "== profile [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda \
  --model benchmarks/models/moe-h3072:1024:6:2048 --policies --profile bf16 fp8-blockwise-hopper --profile-top 30 \
  --out $OUT/s12a/profile.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
