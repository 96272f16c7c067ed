#!/usr/bin/env bash
# Session 18's fifth call (1 x H200; carry .whl and .device_commit): the Qwen3 L8 bench row with its anchor again (18c's
# results JSON stayed on the device: a call returns at most 8 files).
#   OUT=/path bash benchmarks/gpu_session18e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row qwen3-L8-4096x2-s18e 400 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
