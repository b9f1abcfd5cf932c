#!/usr/bin/env bash
# Session 11, H200: GPU tests, then every policy side by side on moe-h3072 (1024 prompts x 8, micro-batches of
# 2048) and bf16 / fp8-blockwise / nvfp4-dequant on the larger moe-h4096 (512 prompts x 8, micro-batches of 1024)
# with a per-phase profile of its BF16 step. Writes $OUT/s11b/{log.txt,h3072.json,h4096.json}.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/s11b; T0=$(date +%s); L=$OUT/s11b/log.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/test_engine_fastgemm.py \
  tests/test_rollout_gpu.py tests/test_engine_loop.py > /tmp/pt.log 2>&1
tail -c 5000 /tmp/pt.log >> $L; grep -E "passed|failed|^FAILED|^ERROR" /tmp/pt.log | tail -12
echo "== h3072 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 260 python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h3072:1024:6:2048 --policies bf16 mxfp8-e2e mxfp8-hp-backward \
  mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16 \
  --out $OUT/s11b/h3072.json 2>&1 | tee -a $L | grep -v "^    "
echo "== h4096 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 575 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 3 --warmup 1 \
  --model benchmarks/models/moe-h4096:512:6:1024 --profile bf16 --profile-top 12 \
  --policies bf16 fp8-blockwise-hopper nvfp4-pertoken-dequant-backward bf16 --out $OUT/s11b/h4096.json 2>&1 \
  | tee -a $L | grep -v "^    "
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
