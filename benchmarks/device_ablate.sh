#!/usr/bin/env bash
# Issue 13's one batched H200 call: GPU checks of the independent rollout path, a warm start of the 43M-parameter
# Qwen3-MoE (benchmarks/models/moe-43m), the seed ablation on it (6 seed policies + BF16 baseline + 2 broken
# contracts, 3 seeds) and the routing-replay comparison, all with the independent rollout numerics.
#
#   run tool: carry [".wheels"], command: `bash benchmarks/device_ablate.sh`   (writes <= 8 files to $OUT)
#
# The number of RL steps is calibrated on the machine so that the whole ablation fits ABL_SECONDS of wall time:
# a 4-step run of the slowest config gives s/step, and 36 runs share the GPU concurrently (their phase times are
# therefore not a speed comparison).
set -o pipefail
source benchmarks/device_setup.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
W=/tmp/w13; mkdir -p $W
ABL_SECONDS=${ABL_SECONDS:-270}
POL="bf16 mxfp8-e2e mxfp8-hp-backward mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
T0=$(date +%s)

echo "== GPU tests"; python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_rollout_gpu.py -s 2>&1 | tail -12 | tee $OUT/gpu_tests.log

echo "== warm start (SFT on 2-digit addition) [$(( $(date +%s) - T0 ))s]"
cp -r benchmarks/models/moe-43m $W/moe-43m
python3 examples/warmstart_tiny_moe.py --model-dir $W/moe-43m --device cuda --batch 256 --lr 1e-3 --eval-every 40 \
    --target 0.35 --max-steps 3000 --max-seconds 70 2>&1 | tail -8 | tee $OUT/warmstart.log

echo "== calibration [$(( $(date +%s) - T0 ))s]"
python3 -m precision_dsl.cli run nvfp4-pertoken-dequant-backward --model $W/moe-43m --device cuda --steps 4 \
    --prompts 32 --out $W/calib --overwrite > $W/calib.log 2>&1
STEPS=$(python3 - <<EOF
import json
recs = [json.loads(l) for l in open("$W/calib/metrics.jsonl")][2:]
t = sum(r["time_rollout_s"] + r["time_train_s"] + r["time_reference_s"] + r["time_weight_update_s"] for r in recs) / len(recs)
# 36 runs on 16 CPU cores / one GPU: measured 2026-12-01: ~3.5x the throughput of one process
print(max(8, min(60, int($ABL_SECONDS * 3.5 / (36 * t)))))
EOF
)
echo "calibrated: $STEPS steps per run"; tail -3 $W/calib.log

echo "== ablation + routing replay, concurrently [$(( $(date +%s) - T0 ))s]"
timeout $(( ABL_SECONDS + 110 )) python3 -m precision_dsl.cli ablate $POL --broken-contract per_tensor \
    --broken-contract unshared --seeds 3 --steps $STEPS --model $W/moe-43m --device cuda --jobs 11 --prompts 32 --lr 5e-5 \
    --out $W/abl > $W/abl.log 2>&1 &
A=$!
timeout $(( ABL_SECONDS + 110 )) python3 -m precision_dsl.cli ablate bf16 mxfp8-dequant-backward \
    nvfp4-pertoken-dequant-backward --routing-replay --seeds 3 --steps $STEPS --model $W/moe-43m --device cuda \
    --jobs 4 --prompts 32 --lr 5e-5 --out $W/r3 > $W/r3.log 2>&1 &
B=$!
wait $A; echo "ablate rc=$?"; wait $B; echo "r3 rc=$?"
for d in abl r3; do
  [ -f $W/$d/ablation.json ] || python3 -m precision_dsl.cli ablate x --summarize-only --out $W/$d >> $W/$d.log 2>&1
done
echo "== done [$(( $(date +%s) - T0 ))s]"
cp $W/abl/ablation.png $OUT/ablation-h200.png; cp $W/abl/ablation.json $OUT/ablation-h200.json
cp $W/r3/ablation.json $OUT/replay-h200.json
tail -c 60000 $W/abl.log > $OUT/abl.log; tail -c 20000 $W/r3.log >> $OUT/abl.log
(cd $W && tar czf $OUT/runs.tgz abl/*/metrics.jsonl abl/*/summary.json r3/*/metrics.jsonl r3/*/summary.json calib.log)
tail -25 $W/abl.log; tail -8 $W/r3.log
