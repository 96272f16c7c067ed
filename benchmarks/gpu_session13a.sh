#!/usr/bin/env bash
# Session 13's first call after gpu_session12a.sh (1 x H200, ~9.5 minutes; carry .whl and .device_commit): the AdamW
# kernels with fewer instructions (the 8-bit codes' arithmetic, the hash index in 32 bits) and the in-backward
# updates on their own stream in their CUDA tests; the kernels timed per expert tensor over launch shapes
# (adamw8_kernel.py) and the combine microbenchmark that 12a's tolerance cut; the update stream's A/B (gpt-oss-20b
# L8, in-backward, 8-bit moments, profile_trainer.py: one stream, then two); then one launch each: gpt-oss-20b L8
# (flex anchor, in-backward rows with full and 8-bit moments) and Qwen3-30B-A3B L8 (anchor, engine, engine_adamw8).
#   OUT=/path bash benchmarks/gpu_session13a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 100 tests/test_adamw8.py tests/test_optim_triton.py tests/test_precision.py tests/test_adamw_multi.py \
  tests/test_backward_updates.py -k "cuda or stream"
for k in adamw8_kernel combine_kernel; do
  timeout 60 python3 benchmarks/$k.py > "$OUT/$k.json" 2> "$OUT/$k.log"
  echo "$k exit $? after $((SECONDS - T0)) s"; tail -c 1200 "$OUT/$k.json"; tail -3 "$OUT/$k.log" | cut -c1-300
done
for flag in --updates-one-stream ""; do
  timeout 75 python3 benchmarks/profile_trainer.py --preset gpt-oss-20b --layers 8 --precision auto --in-backward \
    --optimizer-states 8bit --warmup 3 --steps 10 --no-trace --out /tmp/ab $flag >> "$OUT/ab.log" 2>&1
  echo "in-backward ${flag:-two streams} exit $? after $((SECONDS - T0)) s"; grep "^auto" "$OUT/ab.log" | tail -1 | cut -c1-400
done
bench_row gpt-oss-20b-L8-s13a 170 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward,engine_in_backward_adamw8
bench_row qwen3-L8-s13a $((580 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_adamw8
