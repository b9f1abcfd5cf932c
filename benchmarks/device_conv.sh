#!/usr/bin/env bash
# Issue 12 goal 2 (converter) on one nvidia-h200, run by the lead through the GPU mailbox:
#   cd .devwork/conv && bash benchmarks/device_conv.sh          ($OUT set; <= 4 minutes; results in $OUT/conv/)
# 1. the GPU converter tests (CUDA output byte-identical to the CPU reference, BF16 and FP8-block sources; NaN/Inf
#    refused on the device path with the CPU path's error);
# 2. benchmarks/convert.py --device cuda on a synthetic BF16 checkpoint in two ~2 GB shards: plain safetensors
#    read+write (+fsync / no fsync / raw byte copy) vs `policyc convert` for bf16, mxfp8-e2e and
#    nvfp4-pertoken-hp-backward, fastest of 2, peak RSS per step; plus one profiled mxfp8 and nvfp4 run (where time goes).
set -uo pipefail
source benchmarks/device_setup.sh
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/conv"
LOG=$OUT/conv/log.txt
{ nvidia-smi -L; nproc; free -g | head -2; df -hT /tmp | tail -1; uname -r; uptime; } 2>&1 | tee -a "$LOG"
echo "== GPU converter tests" | tee -a "$LOG"
timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider --tb=short tests/test_converter.py \
  tests/test_fp8_source.py 2>&1 | tail -25 | tee -a "$LOG"
echo "== converter benchmark, --device cuda, 2 x ~2 GB shards" | tee -a "$LOG"
timeout ${CONV_TIMEOUT:-170} python3 benchmarks/convert.py --device cuda --shard-gb ${CONV_SHARD_GB:-2} --shards 2 \
  --repeat 2 --no-verify --policies bf16,mxfp8-e2e,nvfp4-pertoken-hp-backward --profile mxfp8-e2e,nvfp4-pertoken-hp-backward \
  --workdir /tmp/policyc-conv-bench ${CONV_ARGS:-} 2>&1 | grep -v -i warn | tee "$OUT/conv/results.md" | tail -30
rm -rf /tmp/policyc-conv-bench
uptime | tee -a "$LOG"
