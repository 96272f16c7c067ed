#!/usr/bin/env bash
# Session 16's closing call (1 x H200; carry .whl and .device_commit): the Qwen3-30B-A3B and Moonlight-16B-A3B L8
# rows (seq 4096 x 2) on the final code (float32 rotary frequencies in the bf16 engine), anchors in each launch.
#   OUT=/path bash benchmarks/gpu_session16g.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row qwen3-L8-4096x2-s16g 135 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
bench_row moonlight-L8-s16g $((270 - SECONDS + T0)) --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
