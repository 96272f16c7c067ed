#!/usr/bin/env bash
# Session 18's sixth call (1 x H200; carry .whl and .device_commit): the CUDA tests of the fused residual adds, the
# norm + RoPE kernel and the engine layers around them, and the Qwen3 L8 bench row with its anchor.
#   OUT=/path bash benchmarks/gpu_session18f.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 200 tests/test_norm_rope.py tests/test_fused_residual.py tests/test_qkv_projection.py tests/test_kernels.py \
  tests/test_generic_features.py tests/test_parity.py -k "cuda or rope or engine or residual or qkv"
bench_row qwen3-L8-4096x2-s18f $((560 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
