#!/usr/bin/env bash
# Issue 12 goal 3 on the H200: GPU tests of the fast trainer GEMM path (engine/fastgemm.py: native FP8 blockwise
# GEMMs, tensor-core GEMMs over bf16-exact dequantized operands) and of the rollout's GEMMs, then the RL step
# benchmark, every policy side by side in one process (bf16 first and last, to see the drift): a compute-bound-sized
# Qwen3-MoE (hidden 3072, benchmarks/models/moe-h3072, random-init weights; 1024 prompts x 8 samples, trainer
# micro-batches of 2048 sequences) and the tiny model (launch-bound). Writes $OUT/rl/{rl_step.json,log.txt}.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/rl; T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/rl/log.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short tests/test_engine_fastgemm.py \
  tests/test_rollout_gpu.py > /tmp/rl_pytest.log 2>&1; tail -c 20000 /tmp/rl_pytest.log >> $OUT/rl/log.txt
grep -E "passed|failed|^FAILED|^ERROR" /tmp/rl_pytest.log | tail -15
echo "== rl_step [$(( $(date +%s) - T0 ))s]" | tee -a $OUT/rl/log.txt
timeout $(( 560 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h3072:1024:6:2048 --model tiny-moe:64:2 --profile-bf16 \
  --policies bf16 mxfp8-e2e mxfp8-hp-backward mxfp8-dequant-backward nvfp4-pertoken-hp-backward \
  nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16 --out $OUT/rl/rl_step.json 2>&1 \
  | tee -a $OUT/rl/log.txt | grep -v "^  "
echo "== done rc=$? [$(( $(date +%s) - T0 ))s]" | tee -a $OUT/rl/log.txt
