#!/usr/bin/env bash
# Session 20's first device call (a device was lent in its last hour): the CUDA tests of sessions 19 and 20's kernels,
# then one round of 20b's A/B (b7ab90f in .ab/s19 / this tree / + expert_wgrad triton / + embedding and router triton),
# then, in the time left, the L8 bench row with all three Triton choices against the v5 anchor.
# Carry .whl, .device_commit and .ab.
#   OUT=/path [SKIP_TESTS=1] bash benchmarks/gpu_session20x.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
[ -n "${SKIP_TESTS:-}" ] || gpu_tests 150 tests/test_row_weights.py tests/test_embedding_grad.py tests/test_router_topk.py tests/test_grouped_wgrad.py \
  tests/test_mm_fp32.py -k "cuda or wgrad or pair or passing"
TORCH_KERNELS="--embedding torch --router torch" NEW_KERNELS="--embedding triton --router triton"
ab_sides 1 s19=s19,--expert-wgrad\ autograd rows="new,--expert-wgrad autograd $TORCH_KERNELS" \
  rows_wgrad="new,--expert-wgrad triton $TORCH_KERNELS" rows_kernels="new,--expert-wgrad autograd $NEW_KERNELS" \
  -- --layers 8 --precision auto --no-trace --steps 20
find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ab-*' -exec rm -rf {} +
bench_row qwen3-L8-4096x2-s20x $((590 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine --expert-wgrad triton --embedding triton --router triton
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
