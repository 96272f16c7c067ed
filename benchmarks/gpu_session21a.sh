#!/usr/bin/env bash
# Session 21's first device call: the CUDA tests of sessions 19 and 20's kernels (never run on a GPU yet), two A/B
# rounds of embedding and router torch against 'triton' (20z: decides their `auto`), then Qwen3 L8 at 16384 x 1
# (last measured in session 18) with both 'triton', beside its v5 anchor. Carry .whl and .device_commit.
#   OUT=/path bash benchmarks/gpu_session21a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 200 tests/test_row_weights.py tests/test_embedding_grad.py tests/test_router_topk.py \
  tests/test_grouped_wgrad.py tests/test_mm_fp32.py tests/test_fused_residual.py tests/test_kernels.py tests/test_parity.py \
  tests/test_generic_features.py \
  -k "cuda or wgrad or pair or passing or engine_match or cross or scale or row or weights or bfloat16 or embedding"
grep -E "^SKIPPED" "$OUT/pytest.log" | head -5 | cut -c1-200
ab_sides 2 rows="new,--expert-wgrad autograd --embedding torch --router torch" \
  rows_kernels="new,--expert-wgrad autograd --embedding triton --router triton" \
  -- --layers 8 --precision auto --no-trace --steps 20
find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ab-*' -exec rm -rf {} +
bench_row qwen3-L8-16384x1-s21a $((585 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 16384 --batch 1 \
  --variants anchor,engine --embedding triton --router triton
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
