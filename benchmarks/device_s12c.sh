#!/usr/bin/env bash
# Session 12, call 3: where fp8-blockwise-hopper's host time goes (cProfile of one step, bf16 beside it), the 1x128
# operand kernels at the trainer's shapes, the engine's GPU tests, and the fp8 padded/rowcol kernel test in full.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/s12c; T0=$(date +%s); L=$OUT/s12c/log.txt
timeout 120 python3 -m pytest -q -x -p no:cacheprovider -m gpu --tb=short tests/test_engine_fastgemm.py \
  tests/test_engine_rollout.py > /tmp/pt.log 2>&1; rc=$?
tail -c 3000 /tmp/pt.log >> $L; tail -c 1500 /tmp/pt.log | grep -E "passed|failed|Error|FAILED" | tail -8
[ $rc -ne 0 ] && { echo "GPU tests rc=$rc: stopping"; tail -c 2500 /tmp/pt.log; exit 1; }
echo "== operands [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 60 python3 benchmarks/fp8_operand_probe.py --out $OUT/s12c/fp8_operands.json 2>&1 | tee -a $L | tail -6
echo "== host profile [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 150 python3 benchmarks/rl_step.py --device cuda --model benchmarks/models/moe-h3072:1024:6:2048 --policies \
  --host-profile bf16 fp8-blockwise-hopper --out $OUT/s12c/host.json 2>&1 | tee -a $L | grep -v "^    \|^  File"
echo "== kernel test [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 330 - ($(date +%s) - T0) )) python3 -m pytest -q -p no:cacheprovider -rf --tb=line tests/test_kernels.py \
  -k padded_col_and_rowcol > /tmp/pk.log 2>&1; cp /tmp/pk.log $OUT/s12c/kernel_test.log
grep -E "passed|failed|FAILED|Error|assert" /tmp/pk.log | cut -c1-700 | tail -6
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
