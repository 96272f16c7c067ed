#!/usr/bin/env bash
# Session 18's third call (1 x H200; carry .whl, .device_commit and .ab with 696579b's workbench/ in .ab/old): the CUDA
# tests of the q/k/v node and the CE changes, a same-machine A/B of this session's step changes (old/new
# alternating, twice), and the Qwen3 L8 bench row with its anchor.
#   OUT=/path bash benchmarks/gpu_session18c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 150 tests/test_qkv_projection.py tests/test_kernels.py tests/test_generic_extras.py \
  -k "qkv or rope or engine or ce or cross or scale or router_modules"
ab_rounds 2 --layers 8 --precision auto --no-trace --steps 20
bench_row qwen3-L8-4096x2-s18c $((570 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
