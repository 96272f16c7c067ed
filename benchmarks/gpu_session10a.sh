#!/usr/bin/env bash
# Session 10, first call after 9h (1 x H200, ~7 minutes; carry .whl and .device_commit): the CUDA-graph tests again
# (9h: 6 failed on one stale assertion, the eager reason's wording; everything before it held), then issue 15's L16 row
# at seq 4096 x 2 (anchor, engine, engine_cuda_graphs in one launch), never run with the trainer's step.
#   OUT=/path bash benchmarks/gpu_session10a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 150 tests/test_stack_graphs.py
bench_row qwen3-L16-4096x2 $((560 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
