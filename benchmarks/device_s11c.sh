#!/usr/bin/env bash
# Session 11, H200: GPU tests, then every policy side by side on moe-h3072 (1024 prompts x 8, micro-batches of
# 2048) and on moe-h4096 (512 prompts x 8, micro-batches of 512) with a per-phase profile of both BF16 steps.
# Writes $OUT/s11c/{log.txt,h3072.json,h4096.json}.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/s11c; T0=$(date +%s); L=$OUT/s11c/log.txt
timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/test_engine_fastgemm.py \
  tests/test_rollout_gpu.py tests/test_engine_rollout.py tests/test_engine_loop.py tests/test_kernels.py \
  -k "not test_kernels or padded_col_and_rowcol" > /tmp/pt.log 2>&1
tail -c 5000 /tmp/pt.log >> $L; grep -E "passed|failed|^FAILED|^ERROR" /tmp/pt.log | tail -12
echo "== h3072 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 250 python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h3072:1024:6:2048 --policies bf16 mxfp8-e2e mxfp8-hp-backward \
  mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16 \
  --out $OUT/s11c/h3072.json 2>&1 | tee -a $L | grep -v "^    "
python3 -c "import json;[print(r['policy'], r['weight_update_path'], r['native_fp8_errors']) for r in json.load(open('$OUT/s11c/h3072.json'))['rows']]"
echo "== h4096 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 580 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 3 --warmup 1 \
  --model benchmarks/models/moe-h4096:512:6:512 --profile bf16 --profile-top 6 \
  --policies bf16 fp8-blockwise-hopper nvfp4-pertoken-dequant-backward mxfp8-e2e bf16 --out $OUT/s11c/h4096.json \
  2>&1 | tee -a $L | grep -v "^    "
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
