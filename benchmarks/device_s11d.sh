#!/usr/bin/env bash
# Session 11, H200 (final call): the GPU tests of this session's changes (stop if any fails), then every policy side
# by side on moe-h3072 (1024 prompts x 8, micro-batches of 2048) and bf16 / fp8-blockwise / nvfp4-dequant /
# mxfp8-e2e on moe-h4096 (512 prompts x 8, micro-batches of 512). Writes $OUT/s11d/{log.txt,h3072.json,h4096.json}.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/s11d; T0=$(date +%s); L=$OUT/s11d/log.txt
timeout 120 python3 -m pytest -q -x -p no:cacheprovider -m gpu --tb=short tests/test_engine_rollout.py \
  tests/test_engine_fastgemm.py tests/test_rollout_gpu.py > /tmp/pt.log 2>&1; rc=$?
tail -c 4000 /tmp/pt.log >> $L; tail -c 1500 /tmp/pt.log | grep -E "passed|failed|Error|FAILED" | tail -8
[ $rc -ne 0 ] && { echo "GPU tests rc=$rc: stopping"; tail -c 2500 /tmp/pt.log; exit 1; }
echo "== h3072 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 240 python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h3072:1024:6:2048 --policies bf16 mxfp8-e2e mxfp8-hp-backward \
  mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16 \
  --out $OUT/s11d/h3072.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
python3 -c "import json;[print(r['policy'], r['weight_update_path'], r['native_fp8_errors']) for r in json.load(open('$OUT/s11d/h3072.json'))['rows']]"
echo "== h4096 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 3 --warmup 1 \
  --model benchmarks/models/moe-h4096:512:6:512 \
  --policies bf16 fp8-blockwise-hopper nvfp4-pertoken-dequant-backward mxfp8-e2e bf16 --out $OUT/s11d/h4096.json \
  2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
