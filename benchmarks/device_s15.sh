#!/usr/bin/env bash
# GPU work of one session on the H200, in steps chosen by STEPS (unset: tests; empty: only the installs): every step
# appends to $OUT/s15/log.txt.
#   STEPS="tests" bash benchmarks/device_s15.sh                 (run tool: carry [".wheels", ".golden"])
# Steps: tests    every -m gpu test of the engine, kernels and weight update (pytest-xdist, 6 workers)
#        wu       benchmarks/weight_update_gpu.py (colocated update, both models)          -> wu.json
#        quant    benchmarks/quantize.py --no-sweep --shapes 16384x7168,8192x2048          -> quant.json
#        rl       benchmarks/rl_step.py, moe-h3072, bf16 / fp8-blockwise-hopper / emulated  -> rl.json
#        conv     benchmarks/convert.py --device cuda                                      -> conv.json
# .wheels: py3.12 wheels of pydantic lark typer rich safetensors pyyaml hypothesis pytest pytest-xdist execnet torchao;
# .golden: a copy of ../shared/golden/quantizers. Neither is committed.
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 POLICYC_GOLDEN_DIR="$PWD/.golden"
python3 -m pip install -q --no-index --find-links .wheels pydantic lark typer rich safetensors pyyaml hypothesis \
  pytest pytest-xdist 2>&1 | tail -2
python3 -m pip install -q --no-deps .wheels/torchao-*.whl 2>&1 | tail -1
D=$OUT/s15; mkdir -p $D; L=$D/log.txt; T0=$(date +%s)
python3 -c "import torch; print('device:', torch.cuda.get_device_name(), torch.__version__)" | tee -a $L
for s in ${STEPS-tests}; do  # STEPS unset: tests; STEPS="": install only
  echo "== $s [$(( $(date +%s) - T0 ))s]" | tee -a $L
  case $s in
    tests) timeout ${TEST_SECS:-420} python3 -m pytest -q -p no:cacheprovider -m gpu -n ${NW:-6} --tb=short -rfE ${TEST_K:+-k "$TEST_K"} \
             ${TESTS:-tests/test_kernels.py tests/test_engine_fastgemm.py tests/test_engine_rollout.py \
             tests/test_engine_grouped_experts.py tests/test_rollout_gpu.py tests/test_weight_update_gpu.py \
             tests/test_mxfp8.py tests/test_nvfp4.py tests/test_fp8_block.py tests/test_fp8_source.py \
             tests/test_converter.py tests/test_engine_loop.py tests/test_engine_remote.py} > $D/tests.log 2>&1
           echo "pytest rc=$?" | tee -a $L; grep -E "passed|failed|FAILED|ERROR" $D/tests.log | tail -30 | tee -a $L ;;
    wu) timeout ${WU_SECS:-300} python3 benchmarks/weight_update_gpu.py --reps 3 --out $D/wu.json ${WU_ARGS:-} 2>&1 \
          | tee -a $L | grep -v "^    \|^  File" ;;
    quant) timeout ${Q_SECS:-240} python3 benchmarks/quantize.py --no-sweep --shapes 16384x7168,8192x2048 \
             --json $D/quant.json ${Q_ARGS:-} 2>&1 | tee -a $L | grep -E "^\||copy|nvfp4|mxfp8|fp8" | head -80 ;;
    rl) timeout ${RL_SECS:-240} python3 benchmarks/rl_step.py --device cuda --steps ${RL_STEPS:-4} --warmup 1 \
          --model benchmarks/models/moe-h3072:1024:6:2048 --policies ${RL_POLICIES:-bf16 mxfp8-e2e \
          nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16} --out $D/rl.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback" ;;
    conv) timeout ${CONV_SECS:-200} python3 benchmarks/convert.py --device cuda --shard-gb ${CONV_GB:-2} --shards 2 \
            --policies bf16,mxfp8-e2e,nvfp4-pertoken-dequant-backward --repeat ${CONV_REPEAT:-3} --no-verify --results $D/conv_results.md 2>&1 | tee -a $L | tail -20 ;;
  esac
done
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
