#!/usr/bin/env bash
# Lead's final H200 call (stop 8): GPU tests of the integrated tree, then the H200 ablation configs the issue-13 run
# could not reach (NVFP4 consistent + broken contract next to BF16 / MXFP8), 3 seeds, independent rollout numerics.
set -o pipefail
source benchmarks/device_setup.sh
export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
W=/tmp/wf; mkdir -p $W; T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu_tests.log
timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_kernels.py tests/test_nvfp4.py tests/test_mxfp8.py \
  tests/test_fp8_block.py tests/test_converter.py tests/test_engine_loop.py tests/test_rollout_gpu.py 2>&1 | tail -15 | tee -a $OUT/gpu_tests.log
echo "== warm start [$(( $(date +%s) - T0 ))s]"
cp -r benchmarks/models/moe-43m $W/moe-43m
python3 examples/warmstart_tiny_moe.py --model-dir $W/moe-43m --device cuda --batch 256 --lr 1e-3 --eval-every 40 \
    --target 0.35 --max-steps 3000 --max-seconds 60 2>&1 | tail -4 | tee $OUT/warmstart.log
echo "== ablation [$(( $(date +%s) - T0 ))s]"
timeout 230 python3 -m precision_dsl.cli ablate bf16 mxfp8-e2e nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward \
    --broken-contract per_tensor --seeds 3 --steps 12 --model $W/moe-43m --device cuda --jobs 15 --prompts 32 --lr 5e-5 \
    --out $W/abl > $W/abl.log 2>&1; echo "ablate rc=$?"
[ -f $W/abl/ablation.json ] || python3 -m precision_dsl.cli ablate x --summarize-only --out $W/abl >> $W/abl.log 2>&1
echo "== done [$(( $(date +%s) - T0 ))s]"
cp $W/abl/ablation.png $OUT/ablation-h200-final.png; cp $W/abl/ablation.json $OUT/ablation-h200-final.json
tail -c 40000 $W/abl.log > $OUT/abl.log
(cd $W && tar czf $OUT/runs.tgz abl/*/metrics.jsonl abl/*/summary.json)
tail -22 $W/abl.log
