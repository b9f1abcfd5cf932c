#!/usr/bin/env bash
# Issue 12 goal 3 on the H200 (session 11): the engine's GPU tests (stop on failure), then every policy side by side
# on moe-h3072 (1024 prompts x 8, micro-batches of 2048) and H4096_POLICIES on moe-h4096 (512 prompts x 8,
# micro-batches of 512). PROFILE="bf16 fp8-blockwise-hopper" also profiles those policies' steps on moe-h3072 (kernel
# time per loop phase). Writes $OUT/s11e/{log.txt,h3072.json,h4096.json}.
#   bash benchmarks/device_s11e.sh                                   # the session's final figures
#   H4096_POLICIES="bf16 fp8-blockwise-hopper nvfp4-pertoken-dequant-backward mxfp8-e2e bf16" bash ...  # its call 4
set -o pipefail
source benchmarks/device_setup.sh
H4096_POLICIES=${H4096_POLICIES:-"bf16 fp8-blockwise-hopper bf16"}
mkdir -p $OUT/s11e; T0=$(date +%s); L=$OUT/s11e/log.txt
gpu_tests 110 $L tests/test_engine_fastgemm.py tests/test_engine_rollout.py
echo "== h3072 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 260 python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h3072:1024:6:2048 --policies bf16 mxfp8-e2e mxfp8-hp-backward \
  mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16 \
  ${PROFILE:+--profile $PROFILE --profile-top 22} --out $OUT/s11e/h3072.json 2>&1 | tee -a $L \
  | grep -v "^    \|^  File\|^Traceback"
echo "== h4096 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 3 --warmup 1 \
  --model benchmarks/models/moe-h4096:512:6:512 --policies $H4096_POLICIES --out $OUT/s11e/h4096.json 2>&1 \
  | tee -a $L | grep -v "^    \|^  File\|^Traceback"
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
