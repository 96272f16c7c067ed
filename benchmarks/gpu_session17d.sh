#!/usr/bin/env bash
# Session 17's closing call (1 x H200; carry .whl with nvidia-ml-py, and .device_commit): the Qwen3-30B-A3B rows of
# issue 15 on the final code, each with its anchor and the rows' SM clock / power (NVML).
#   OUT=/path bash benchmarks/gpu_session17d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 60 tests/test_gpu_clocks.py
bench_row qwen3-L8-4096x2-s17d 150 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L16-4096x2-s17d 210 --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L8-16384x1-s17d $((575 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 16384 --batch 1 \
  --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
