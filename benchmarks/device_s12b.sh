#!/usr/bin/env bash
# Session 12, call 2: GPU tests, then moe-h3072 every policy (bf16 first and last), then moe-h4096 with bf16 and
# fp8-blockwise-hopper alternating (bf16 fp8 bf16 fp8 bf16: the BF16 spread measured, not assumed), then (time left)
# per-phase profiles of bf16 and fp8-blockwise-hopper on moe-h3072. Writes $OUT/s12b/.
set -o pipefail
source benchmarks/device_setup.sh
mkdir -p $OUT/s12b; T0=$(date +%s); L=$OUT/s12b/log.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider -rf --tb=short tests/test_kernels.py -k padded_col_and_rowcol \
  > /tmp/pk.log 2>&1; grep -E "passed|failed|assert|FAILED|Error" /tmp/pk.log | cut -c1-600 | tail -12 | tee -a $L
timeout 150 python3 -m pytest -q -x -p no:cacheprovider -m gpu --tb=short tests/test_engine_fastgemm.py \
  tests/test_engine_rollout.py > /tmp/pt.log 2>&1; rc=$?
tail -c 4000 /tmp/pt.log >> $L; tail -c 1500 /tmp/pt.log | grep -E "passed|failed|Error|FAILED" | tail -8
[ $rc -ne 0 ] && { echo "GPU tests rc=$rc: stopping"; tail -c 2500 /tmp/pt.log; exit 1; }
echo "== h3072 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 240 python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h3072:1024:6:2048 --policies bf16 mxfp8-e2e mxfp8-hp-backward \
  mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward fp8-blockwise-hopper bf16 \
  --out $OUT/s12b/h3072.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
echo "== h4096 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 500 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 3 --warmup 1 \
  --model benchmarks/models/moe-h4096:512:6:512 --policies ${H4096_POLICIES:-bf16 fp8-blockwise-hopper bf16 \
  fp8-blockwise-hopper bf16} --out $OUT/s12b/h4096.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
echo "== profile [$(( $(date +%s) - T0 ))s]" | tee -a $L
left=$(( 585 - ($(date +%s) - T0) ))
[ $left -gt 80 ] && timeout $left python3 benchmarks/rl_step.py --device cuda \
  --model benchmarks/models/moe-h3072:1024:6:2048 --policies --profile bf16 fp8-blockwise-hopper --profile-top 30 \
  --out $OUT/s12b/profile.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback\|^  [a-z_]*: GEMM\|^ *[0-9.]* ms"
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
