#!/usr/bin/env bash
# Session 18's fourth call (1 x H200; carry .whl and .device_commit): Qwen3 L16 at 4096 x 2 and L8 at 16384 x 1, each
# with its anchor in the same launch.
#   OUT=/path bash benchmarks/gpu_session18d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row qwen3-L16-4096x2-s18d 230 --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L8-16384x1-s18d $((575 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 16384 --batch 1 \
  --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
