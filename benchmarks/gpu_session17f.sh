#!/usr/bin/env bash
# Session 17's closing call (1 x H200; carry .whl with nvidia-ml-py, and .device_commit): the CUDA tests of the
# session's kernels and test helper, then the Qwen3-30B-A3B L8 and L16 rows (seq 4096 x 2) on the final code, each
# with its anchor and the rows' SM clock / power.
#   OUT=/path bash benchmarks/gpu_session17f.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 150 tests/test_precision.py tests/test_optim_triton.py tests/test_kernels.py tests/test_gpu_clocks.py \
  -k "one_division or bit_for_bit or cuda or weight_gradient_from_its_partials or busy"
bench_row qwen3-L8-4096x2-s17f 150 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L16-4096x2-s17f $((560 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 \
  --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
