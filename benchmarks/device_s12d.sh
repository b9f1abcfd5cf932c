#!/usr/bin/env bash
# Issue 12 goal 3 on the H200 (session 12): the engine's GPU tests (stop on failure), moe-h3072 every policy side by
# side (bf16 first and last), then moe-h4096 with bf16 and fp8-blockwise-hopper alternating three times each
# (medians per policy: the BF16 spread is measured, not assumed). Writes $OUT/s12/{log.txt,h3072.json,h4096.json}.
#   bash benchmarks/device_s12d.sh                                # the session's final figures (its call 4)
# Knobs for the session's probe calls (calls 1-3 ran these steps from scripts since folded into this one):
#   PROBES=1           also the fused-op and FP8-operand probes (fused_ops.json, fp8_operands.json)
#   PROFILE="bf16 fp8-blockwise-hopper"        kernel time per loop phase on moe-h3072 (profile.json)
#   HOST_PROFILE="bf16 fp8-blockwise-hopper"   cProfile of one step on moe-h3072 (host.json)
#   PMODEL=benchmarks/models/moe-h4096:512:6:512   the model the profiles run on (default: moe-h3072's spec below)
#   KERNEL_TEST=1      also tests/test_kernels.py's fp8_block padded / row+col test (NaN edge rows), after the rest
#   RUNS=0             skip the side-by-side runs (probes / profiles only)
#   TINY=1             also every policy on the bundled tiny-moe (64 prompts x 8; the launch-bound reference numbers)
set -o pipefail
source benchmarks/device_setup.sh
D=$OUT/s12; mkdir -p $D; T0=$(date +%s); L=$D/log.txt
H3072=benchmarks/models/moe-h3072:1024:6:2048
gpu_tests 150 $L tests/test_engine_fastgemm.py tests/test_engine_rollout.py tests/test_engine_grouped_experts.py
if [ -n "$PROBES" ]; then
  echo "== probes [$(( $(date +%s) - T0 ))s]" | tee -a $L
  timeout 150 python3 benchmarks/fused_ops_probe.py --out $D/fused_ops.json 2>&1 | tee -a $L | grep -v "^    "
  timeout 60 python3 benchmarks/fp8_operand_probe.py --out $D/fp8_operands.json 2>&1 | tee -a $L | tail -6
fi
if [ -n "$PROFILE$HOST_PROFILE" ]; then
  echo "== profiles [$(( $(date +%s) - T0 ))s]" | tee -a $L
  timeout 300 python3 benchmarks/rl_step.py --device cuda --model ${PMODEL:-$H3072} --policies \
    ${PROFILE:+--profile $PROFILE --profile-top 30} ${HOST_PROFILE:+--host-profile $HOST_PROFILE} \
    --out $D/profile.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
fi
kernel_test() {
  [ -n "$KERNEL_TEST" ] || return 0
  echo "== kernel test [$(( $(date +%s) - T0 ))s]" | tee -a $L
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rf --tb=line \
    "tests/test_kernels.py::test_fp8_block_padded_col_and_rowcol_match_reference" 2>&1 | tail -15 | tee -a $L
}
[ "${RUNS:-1}" = 0 ] && { kernel_test; echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L; exit 0; }
echo "== h3072 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout 200 python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 --model $H3072 --policies bf16 \
  mxfp8-e2e mxfp8-hp-backward mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward \
  fp8-blockwise-hopper bf16 --out $D/h3072.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
echo "== h4096 [$(( $(date +%s) - T0 ))s]" | tee -a $L
timeout $(( 470 - ($(date +%s) - T0) )) python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
  --model benchmarks/models/moe-h4096:512:6:512 --policies bf16 fp8-blockwise-hopper bf16 fp8-blockwise-hopper \
  bf16 fp8-blockwise-hopper --out $D/h4096.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback"
if [ -n "$TINY" ]; then
  echo "== tiny-moe [$(( $(date +%s) - T0 ))s]" | tee -a $L
  timeout 150 python3 benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 --policies bf16 mxfp8-e2e \
    mxfp8-hp-backward mxfp8-dequant-backward nvfp4-pertoken-hp-backward nvfp4-pertoken-dequant-backward \
    fp8-blockwise-hopper bf16 --out $D/tiny.json 2>&1 | tee -a $L | grep -v "^    \|^  File\|^Traceback\|: done ("
fi
kernel_test
echo "== done [$(( $(date +%s) - T0 ))s]" | tee -a $L
