#!/usr/bin/env bash
# Session 10, third call (1 x H200, ~7 minutes; carry .whl and .device_commit): the fused MLA q/k/v kernel
# (kernels/triton_mla.py) and the equal CE chunks, compiled: their tests and the graph tests (tiny deepseek_v3 now
# runs the kernel), then Moonlight L8 (anchor, engine, engine_cuda_graphs) and Qwen3 L8 (anchor, engine), seq 4096 x 2.
#   OUT=/path bash benchmarks/gpu_session10c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 170 tests/test_mla_attention.py tests/test_stack_graphs.py tests/test_kernels.py
bench_row moonlight-L8-mla 170 --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
bench_row qwen3-L8-4096x2-s10 $((580 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
