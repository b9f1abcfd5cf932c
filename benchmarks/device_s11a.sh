#!/usr/bin/env bash
# Session 11, first H200 call: GPU tests of the trainer/rollout fast paths (incl. the TE-style BF16 dequantized
# backward), then a per-phase kernel profile of one bf16 and one fp8-blockwise step, then bf16 / nvfp4-dequant /
# fp8 side by side. Writes $OUT/s11a/{log.txt,rl_step.json}.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/s11a; T0=$(date +%s); L=$OUT/s11a/log.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/test_engine_fastgemm.py \
  tests/test_rollout_gpu.py tests/test_engine_rollout.py tests/test_engine_loop.py > /tmp/pt.log 2>&1
tail -c 6000 /tmp/pt.log >> $L; grep -E "passed|failed|^FAILED|^ERROR" /tmp/pt.log | tail -12
echo "== rl_step [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 570 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h3072:1024:6:2048 --profile bf16 fp8-blockwise-hopper --profile-top 22 \
  --policies bf16 nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16 --out $OUT/s11a/rl_step.json 2>&1 \
  | tee -a $L | grep -v "^      "
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
