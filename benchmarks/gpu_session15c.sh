#!/usr/bin/env bash
# Session 15's third call (1 x H200; carry .device_commit): GPT-OSS with its full causal layers on cuDNN and its
# RoPE on the fused kernel (models/gpt_oss_attention.py). Their CUDA tests; then one launch each, the anchors in the
# same launch: gpt-oss-20b L8 seq 4096 x 2 (anchor_flex, engine_in_backward, engine_in_backward_adamw8) and
# Qwen3-30B-A3B L8 seq 4096 x 2 (anchor, engine).
#   OUT=/path bash benchmarks/gpu_session15c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 150 tests/test_kernels.py tests/test_attention_sinks.py -k "rope or cuda"
bench_row gpt-oss-20b-L8-s15c 300 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward,engine_in_backward_adamw8
bench_row qwen3-L8-4096x2-s15c $((570 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
