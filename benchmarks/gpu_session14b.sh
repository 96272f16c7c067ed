#!/usr/bin/env bash
# Session 14's second call (1 x H200; carry .whl and .device_commit): issue 15's other goal rows, each with its
# anchors in its own launch: Qwen3-30B-A3B L16 seq 4096 x 2, then L8 with anchor_liger (Liger's kernels compile
# for ~4 minutes on a fresh machine, so it runs last and gets the rest of the ~9 minutes).
#   OUT=/path bash benchmarks/gpu_session14b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row qwen3-L16-4096x2-s14b 170 --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 --variants anchor,engine
bench_row qwen3-L8-4096x2-s14b $((540 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,anchor_liger
