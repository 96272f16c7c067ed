#!/usr/bin/env bash
# Session 17's energy check (1 x H200; carry .whl and .device_commit): the NVML energy counter's CUDA test and one
# Qwen3 L8 launch with each row's joules per step beside its clock.
#   OUT=/path bash benchmarks/gpu_session17h.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 60 tests/test_gpu_clocks.py
bench_row qwen3-L8-4096x2-s17h 170 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
