#!/usr/bin/env bash
# Session 13's second call (1 x H200; carry .whl and .device_commit; at most 8 files under $OUT come
# back, so one log per kind): the 8-bit decode by an exact power-of-two multiply and the in-backward updates whose
# kernels sum the gradients' squares in their CUDA tests, then one launch each: Moonlight-16B-A3B L8 (issue 14's
# 1.6x goal, with session 12's combine forward and RMSNorm backward), gpt-oss-20b L8 (flex anchor, in-backward with
# 8-bit moments: the update stream and the fused norm), Qwen3-30B-A3B L8 with anchor_liger (issue 15's
# second anchor, last measured in session 8); Moonlight first; rows after the device time left are cut.
#   OUT=/path bash benchmarks/gpu_session13b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row moonlight-L8-s13b 115 --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
gpu_tests 75 tests/test_adamw8.py tests/test_backward_updates.py tests/test_optim_triton.py -k "cuda or stream"
bench_row gpt-oss-20b-L8-s13b 110 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward_adamw8
bench_row qwen3-L8-s13b $((420 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,anchor_liger,engine
