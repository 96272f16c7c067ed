#!/usr/bin/env bash
# Session 21's second device call: the Qwen3 L8 and L16 bench rows with the defaults (after 21a's A/B set the
# embedding and router `auto`) against the v5 anchor in the same launch, then where L8's step goes now:
# profile_trainer.py's profiled step with its CUDA-only trace kept (the kernel list; s17a's is the last one).
# Carry .whl and .device_commit.
#   OUT=/path bash benchmarks/gpu_session21b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row qwen3-L8-4096x2-s21b 150 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
bench_row qwen3-L16-4096x2-s21b 240 --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 --variants anchor,engine
grep -E "^gpu clocks" "$OUT/bench.log" | tail -2
timeout $((585 - SECONDS + T0)) python3 benchmarks/profile_trainer.py --layers 8 --precision auto --idle \
  --out "$OUT/prof" > "$OUT/prof.log" 2>&1
echo "profile exit $? after $((SECONDS - T0)) s"; grep -E "^auto" "$OUT/prof.log" | cut -c1-700
