#!/usr/bin/env bash
# The seed article's ablation on the bundled tiny MoE: BF16, MXFP8 end to end, MXFP8 / NVFP4 with high-precision or
# dequantized backward, plus one NVFP4 run whose rollout uses per-tensor instead of per-token activation scales
# (--broken-contract), so its train-rollout mismatch stands out. Emulated numerics on CPU; ~6 s/step total per
# step of all configs on 2 idle cores, so the defaults below take roughly 15-20 minutes.
set -euo pipefail
STEPS="${STEPS:-60}"
SEEDS="${SEEDS:-3}"
policyc ablate bf16 mxfp8-e2e mxfp8-hp-backward mxfp8-dequant-backward \
  nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward \
  --seeds "$SEEDS" --steps "$STEPS" --broken-contract per_tensor --broken-contract unshared --jobs "${JOBS:-2}" --out "${OUT:-runs/ablation-seed}" "$@"
