#!/usr/bin/env bash
# Prepare the H200 device machine (no network there): install the pure-Python deps policyc needs that the device image
# lacks (pydantic, lark, torchao for the peer benchmark) from wheels carried in .wheels/, and make the repo importable.
#
# Here (once):  pip download pydantic lark torchao==0.18.0 --python-version 3.12 --only-binary=:all: \
#                   --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d .wheels
# On the device: source benchmarks/device_setup.sh   (run tool: carry [".wheels"])
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # keep NVLink multicast off
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .wheels ]; then
  python3 -m pip install -q --no-index --find-links .wheels pydantic lark 2>&1 | tail -1 || true
  ls .wheels/torchao-*.whl >/dev/null 2>&1 && python3 -m pip install -q --no-deps .wheels/torchao-*.whl 2>&1 | tail -1 || true
fi
python3 -c "import torch, pydantic, lark; print('device:', torch.cuda.device_count(), 'GPU(s)', torch.__version__, 'pydantic', pydantic.VERSION)"

# gpu_tests SECONDS LOG FILE... : the engine's GPU tests (-m gpu) on FILE..., the tail appended to LOG and the summary
# printed; a failure prints its tail and stops the calling script (device time is not spent on a broken tree).
gpu_tests() {
  local secs=$1 log=$2; shift 2
  timeout "$secs" python3 -m pytest -q -x -p no:cacheprovider -m gpu --tb=short "$@" > /tmp/pt.log 2>&1
  local rc=$?
  tail -c 4000 /tmp/pt.log >> "$log"; tail -c 1500 /tmp/pt.log | grep -E "passed|failed|Error|FAILED" | tail -8
  if [ $rc -ne 0 ]; then echo "GPU tests rc=$rc: stopping"; tail -c 2500 /tmp/pt.log; exit 1; fi
}
