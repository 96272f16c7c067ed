#!/usr/bin/env bash
# Session 16's third call (1 x H200; carry .whl and .device_commit): the sink attention's glue on Triton
# (kernels/triton_attention_sinks.py): its CUDA tests and the kernel-level A/B against the torch-op glue; then one
# launch per model with its anchor: gpt-oss-20b L8 (issue 14's goal: >= 2.0x anchor_flex at <= 0.6x memory),
# Qwen3-30B-A3B L8 and Moonlight-16B-A3B L8 (seq 4096 x 2 each).
#   OUT=/path bash benchmarks/gpu_session16c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 90 tests/test_attention_sinks.py -k "cuda"
timeout 60 python3 benchmarks/attention_sinks.py "$OUT/glue.json" flash,cudnn,flash_torch_glue,cudnn_torch_glue \
  2>&1 | grep -vi warn | cut -c1-200
echo "glue A/B done after $((SECONDS - T0)) s"
bench_row gpt-oss-20b-L8-s16c 200 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward_adamw8,engine_in_backward
bench_row qwen3-L8-4096x2-s16c 140 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
bench_row moonlight-L8-s16c $((585 - SECONDS + T0)) --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
