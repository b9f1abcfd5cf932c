#!/bin/bash
# A hand-written Miles launch (scripts/run_qwen3_30b_a3b.py --train-nvfp4 --rollout-nvfp4 style) with two drifts
# for `policyc audit` to find: NVTE_NVFP4_ROW_SCALED_ACTIVATION is missing from the trainer's env, and the trainer
# keeps the last 2 layers BF16 while the rollout checkpoint (ckpt/) excludes only the last one.
set -ex
export SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1
export FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1 TRTLLM_DISABLE_FP4_QUANT_FAST_MATH=1
python3 train.py \
   --hf-checkpoint ckpt \
   --transformer-impl transformer_engine --bf16 \
   --fp4-format e2m1 --fp4-recipe nvfp4 --moe-grouped-gemm \
   --first-last-layers-bf16 --num-layers-at-start-in-bf16 0 --num-layers-at-end-in-bf16 2 \
   --te-precision-config-file te_precision.yaml \
   --train-env-vars '{"NVTE_NVFP4_DISABLE_2D_QUANTIZATION": "1", "NVTE_NVFP4_DISABLE_RHT": "1", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING": "1", "NVTE_BACKWARD_OVERRIDE": "high_precision"}' \
   --sglang-moe-runner-backend flashinfer_trtllm_routed --sglang-kv-cache-dtype bf16 \
   --rollout-num-gpus-per-engine 1 --advantage-estimator grpo
