#!/usr/bin/env bash
# Session 11, third call (1 x H200, ~9 minutes; carry .whl and .device_commit): the CE's new chunk rule
# (TRAINED_HEAD_CE_BYTES: one chunk for 4096 x 2 tokens) in the CE tests on CUDA, then one launch each:
# Qwen3 L8 seq 4096 x 2 (anchor, engine, engine_cuda_graphs), Moonlight L8 (anchor, engine), a Moonlight profile
# (where the step goes now) and Qwen3 L8 seq 16384 x 1 (anchor, engine) with what time is left.
#   OUT=/path bash benchmarks/gpu_session11c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 60 tests/test_kernels.py
bench_row qwen3-L8-4096x2-s11 190 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
bench_row moonlight-L8-s11 150 --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
timeout 60 python3 benchmarks/profile_trainer.py --preset moonlight-16b-a3b --layers 8 --precision auto \
  --out /tmp/prof-moonlight > "$OUT/profile.log" 2>&1
echo "profile exit $? after $((SECONDS - T0)) s"; cp /tmp/prof-moonlight/profile-trainer.json "$OUT/profile-moonlight.json"
grep "^auto" "$OUT/profile.log" | tail -1 | cut -c1-300
bench_row qwen3-L8-16384x1-s11 $((585 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 16384 --batch 1 \
  --variants anchor,engine
