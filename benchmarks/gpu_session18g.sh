#!/usr/bin/env bash
# Session 18's seventh call (1 x H200; carry .whl, .device_commit and .ab with 862f768's workbench/ in .ab/old): the
# CUDA tests of the residual adds in the combine and the engine layer, a same-machine A/B of the session's layer
# fusions (residual adds, norm + RoPE, old/new alternating, twice), and the Qwen3 L8 and L16 bench rows.
#   OUT=/path bash benchmarks/gpu_session18g.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 120 tests/test_fused_residual.py tests/test_kernels.py tests/test_generic_features.py \
  -k "cuda and (residual or combine or engine or activation)"
ab_rounds 2 --layers 8 --precision auto --no-trace --steps 20
bench_row qwen3-L8-4096x2-s18g 110 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L16-4096x2-s18g $((540 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 \
  --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
# a call returns at most 8 files: the A/B's profile JSONs go (their figures are in the logs), the bench JSONs stay
find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ab-*' -exec rm -rf {} +
