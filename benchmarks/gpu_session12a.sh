#!/usr/bin/env bash
# Session 12's call for the next device time (1 x H200, ~9 minutes; carry .whl and .device_commit): the 8-bit AdamW
# kernel compiled against its torch ops (tests/test_adamw8.py on CUDA), then gpt-oss-20b L8 in one launch with the
# flex anchor, the in-backward rows with full and 8-bit moments (issue 14's memory goal: <= 0.6x the anchor at
# >= 2.0x; predicted 8-bit in-backward ~43 GiB = 0.52x at ~2.0x, the update 10 instead of 14 bytes per element),
# then Qwen3-30B-A3B L8 engine vs engine_adamw8 beside its anchor (with session 12's combine forward and RMSNorm
# backward), and the combine and RMSNorm kernels' microbenchmarks (new against the old, same launch).
#   OUT=/path bash benchmarks/gpu_session12a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 90 tests/test_adamw8.py tests/test_optim_triton.py tests/test_precision.py tests/test_kernels.py -k "cuda or combine_matches or rope_and_engine"
bench_row gpt-oss-20b-L8-s12a 230 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward,engine_in_backward_adamw8,engine_adamw8
bench_row qwen3-L8-s12a 150 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_adamw8
for k in combine_kernel rms_norm_kernel; do
  timeout $(((570 - SECONDS + T0) / 2)) python3 benchmarks/$k.py > "$OUT/$k.json" 2> "$OUT/$k.log"
  echo "$k exit $? after $((SECONDS - T0)) s"; tail -c 1500 "$OUT/$k.json"
done
