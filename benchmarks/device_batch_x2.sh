#!/usr/bin/env bash
# The H200 x2 batch behind the GPU rows of benchmarks/RESULTS.md (issue 6 and the GPU re-checks), one device call:
#   run tool, kind nvidia-h200-x2, carry [".golden", ".wheels"]:  bash benchmarks/device_batch_x2.sh
# .golden = a copy of ../shared/golden/quantizers (never committed); .wheels = see benchmarks/device_setup.sh.
set -uo pipefail
source benchmarks/device_setup.sh
OUT=${OUT:-/tmp/out}
LOG=$OUT/log.txt
nvidia-smi -L | tee -a $LOG
echo "== GPU tests (kernels, references on CUDA, engine, converter, 2-GPU run)" | tee -a $LOG
POLICYC_GOLDEN_DIR=.golden timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -n 8 \
  tests/test_kernels.py tests/test_mxfp8.py tests/test_nvfp4.py tests/test_fp8_block.py tests/test_converter.py \
  tests/test_engine_loop.py tests/test_engine_rollout.py 2>&1 | tail -6 | tee -a $LOG
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_engine_remote.py 2>&1 | tail -3 | tee -a $LOG
echo "== two_gpu.py" | tee -a $LOG
timeout 150 python3 benchmarks/two_gpu.py --out $OUT/two_gpu.json 2>&1 | grep -v Warning | tee -a $LOG
echo "== policyc run: trainer cuda:0, rollout process on cuda:1 (NCCL)" | tee -a $LOG
timeout 110 python3 -m precision_dsl.cli run --device cuda --rollout-device cuda:1 --steps 20 --out $OUT/run2gpu \
  2>&1 | tail -4 | tee -a $LOG
echo "== convert benchmark, quantization on cuda:0 (Triton kernels)" | tee -a $LOG
timeout 110 python3 benchmarks/convert.py --device cuda --layers 6 --shards 3 --repeat 2 \
  --policies bf16,mxfp8-e2e,nvfp4-pertoken-hp-backward 2>&1 | tail -10 | tee -a $LOG
