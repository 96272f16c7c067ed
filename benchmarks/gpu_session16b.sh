#!/usr/bin/env bash
# Session 16's second call (1 x H200; carry .whl and .device_commit): GPT-OSS's fused RoPE now runs on Transformers
# 5.17 too (its rotary embedding hands cos/sin as transposed views, which sent every layer to the eager RoPE: the
# profile of gpu_session16a.sh). The RoPE test, then gpt-oss-20b L8 seq 4096 x 2 with the flex anchor in the launch.
#   OUT=/path bash benchmarks/gpu_session16b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 100 tests/test_kernels.py -k "gpt_oss_fused_rope"
bench_row gpt-oss-20b-L8-s16b $((580 - SECONDS + T0)) --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward_adamw8,engine_in_backward
