#!/usr/bin/env bash
# Session 21's last device call: Qwen3 L8 (then L16, as time allows) at 4096 x 2 with every backend choice at its
# default (`auto`), against the v5 anchor in the same launch. Carry .whl and .device_commit.
#   OUT=/path bash benchmarks/gpu_session21d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row qwen3-L8-4096x2-s21d 120 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L16-4096x2-s21d $((${LIMIT:-290} - SECONDS + T0)) --preset qwen3-30b-a3b --layers 16 --seq 4096 \
  --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
