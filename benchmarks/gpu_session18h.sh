#!/usr/bin/env bash
# Session 18's last call (1 x H200; carry .whl and .device_commit): the Qwen3 L8 and L16 bench rows with their anchors
# on the session's final step code (another board: launches on different machines spread ~2-3%).
#   OUT=/path bash benchmarks/gpu_session18h.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row qwen3-L8-4096x2-s18h 100 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L16-4096x2-s18h $((235 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 \
  --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
