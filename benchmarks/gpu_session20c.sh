#!/usr/bin/env bash
# Session 20's third device call (session 19's 19c, renamed rows): the Qwen3 L8 and L16 bench rows with
# WGRAD (default triton; autograd if 20b found it slower), EMBED and ROUTER (default triton; torch likewise) against
# the v5 anchor in the same launch. Carry .whl and .device_commit.
#   OUT=/path WGRAD=triton EMBED=triton ROUTER=triton bash benchmarks/gpu_session20c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
WGRAD="${WGRAD:-triton}" EMBED="${EMBED:-triton}" ROUTER="${ROUTER:-triton}"
bench_row qwen3-L8-4096x2-s20c 150 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine \
  --expert-wgrad "$WGRAD" --embedding "$EMBED" --router "$ROUTER"
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L16-4096x2-s20c $((560 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 \
  --variants anchor,engine --expert-wgrad "$WGRAD" --embedding "$EMBED" --router "$ROUTER"
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
