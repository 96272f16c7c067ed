#!/usr/bin/env bash
# Session 14's first call after 13b (1 x H200; carry .whl and .device_commit; at most 8 files come back): 13b measured
# the in-backward 8-bit row 7.8 ms slower with the kernels' fused norm (its m/v loads masked by the block's sum,
# so they waited for the reduction). Here, with the sum masking the stores only: the kernels with and without
# the sums (adamw8_kernel.py), their CUDA tests, gpt-oss-20b L8 (flex anchor, in-backward bf16 and 8-bit
# moments), Qwen3-30B-A3B L8 and seq 16384 x 1 (issue 15's goals), rows after the device time left cut.
#   OUT=/path bash benchmarks/gpu_session14a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 60 python3 benchmarks/adamw8_kernel.py > "$OUT/adamw8_kernel.json" 2>&1
echo "adamw8_kernel exit $? after $((SECONDS - T0)) s"; cut -c1-400 "$OUT/adamw8_kernel.json"
gpu_tests 60 tests/test_adamw8.py tests/test_backward_updates.py -k "cuda or stream"
bench_row gpt-oss-20b-L8-s14a 150 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward_adamw8,engine_in_backward
bench_row qwen3-L8-4096x2-s14a 100 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
bench_row qwen3-L8-16384x1-s14a $((560 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 16384 --batch 1 \
  --variants anchor,engine
