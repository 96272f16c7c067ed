#!/usr/bin/env bash
# Session 16's fifth call (1 x H200; carry .whl and .device_commit): gpt-oss-20b L8 seq 4096 x 2 once more on a
# fresh machine, with the clipping engine row (the README's headline) beside the in-backward rows and anchor_flex.
#   OUT=/path bash benchmarks/gpu_session16e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
bench_row gpt-oss-20b-L8-s16e 300 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine,engine_in_backward_adamw8,engine_in_backward
