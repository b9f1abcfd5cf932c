#!/usr/bin/env bash
# Session 12, final call: the engine's GPU tests (stop on failure), moe-h3072 every policy side by side (bf16 first
# and last), then moe-h4096 with bf16 and fp8-blockwise-hopper alternating three times each (medians of the three
# runs per policy: the BF16 spread is measured, not assumed). Writes $OUT/s12d/{log.txt,h3072.json,h4096.json}.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/s12d; T0=$(date +%s); L=$OUT/s12d/log.txt
timeout 120 python3 -m pytest -q -x -p no:cacheprovider -m gpu --tb=short tests/test_engine_fastgemm.py \
  tests/test_engine_rollout.py > /tmp/pt.log 2>&1; rc=$?
tail -c 3000 /tmp/pt.log >> $L; tail -c 1500 /tmp/pt.log | grep -E "passed|failed|Error|FAILED" | tail -8
[ $rc -ne 0 ] && { echo "GPU tests rc=$rc: stopping"; tail -c 2500 /tmp/pt.log; exit 1; }
echo "== h3072 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 200 python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h3072:1024:6:2048 --policies bf16 mxfp8-e2e mxfp8-hp-backward \
  mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16 \
  --out $OUT/s12d/h3072.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
echo "== h4096 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 470 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h4096:512:6:512 --policies bf16 fp8-blockwise-hopper bf16 fp8-blockwise-hopper \
  bf16 fp8-blockwise-hopper --out $OUT/s12d/h4096.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
