#!/usr/bin/env bash
# The merged tree's GPU tests on the H200 (every -m gpu test of the files below, golden vectors carried in
# .golden/), stopping at nothing: the log lists each failure. Writes $OUT/s14/gpu_tests.log.
#   bash benchmarks/device_s14.sh          (run tool: carry [".wheels", ".golden"]; .golden = a copy of ../shared/golden/quantizers, never committed)
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 POLICYC_GOLDEN_DIR="$PWD/.golden"
python3 -m pip install -q --no-index --find-links .wheels pydantic lark typer rich safetensors pyyaml hypothesis \
  pytest 2>&1 | tail -2
python3 -c "import torch, pydantic, lark, typer; print('device:', torch.cuda.get_device_name(), torch.__version__)"
D=$OUT/s14; mkdir -p $D
timeout ${SECS:-520} python3 -m pytest -q -p no:cacheprovider -m gpu --tb=short -rfE \
  tests/test_kernels.py tests/test_engine_fastgemm.py tests/test_engine_rollout.py tests/test_engine_grouped_experts.py \
  tests/test_rollout_gpu.py tests/test_weight_update_gpu.py tests/test_mxfp8.py tests/test_nvfp4.py \
  tests/test_fp8_block.py tests/test_fp8_source.py tests/test_converter.py tests/test_engine_loop.py \
  ${EXTRA:-} 2>&1 | tee $D/gpu_tests.log | grep -E "passed|failed|FAILED|ERROR" | tail -40
