#!/usr/bin/env bash
# Session 13's first call after gpu_session12a.sh (1 x H200, ~9 minutes; carry .whl and .device_commit): the AdamW
# kernels with fewer instructions (the 8-bit codes' arithmetic, the hash index in 32 bits) in their CUDA tests and
# timed per expert tensor over launch shapes (adamw8_kernel.py), the combine microbenchmark that 12a's tolerance cut,
# then one launch each: gpt-oss-20b L8 (flex anchor, in-backward rows with full and 8-bit moments), Qwen3-30B-A3B
# L8 (anchor, engine, engine_adamw8) and Moonlight L8 (anchor, engine: issue 14's 1.6x goal).
#   OUT=/path bash benchmarks/gpu_session13a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 90 tests/test_adamw8.py tests/test_optim_triton.py tests/test_precision.py tests/test_adamw_multi.py -k cuda
for k in adamw8_kernel combine_kernel; do
  timeout 60 python3 benchmarks/$k.py > "$OUT/$k.json" 2> "$OUT/$k.log"
  echo "$k exit $? after $((SECONDS - T0)) s"; tail -c 1200 "$OUT/$k.json"; tail -3 "$OUT/$k.log" | cut -c1-300
done
bench_row gpt-oss-20b-L8-s13a 170 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward,engine_in_backward_adamw8
bench_row qwen3-L8-s13a 80 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_adamw8
bench_row moonlight-L8-s13a $((575 - SECONDS + T0)) --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
