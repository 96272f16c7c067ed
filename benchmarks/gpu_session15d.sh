#!/usr/bin/env bash
# Session 15's fourth call (1 x H200; carry .device_commit): the GPT-OSS gate's backward without its in-pass bias
# partials (one segmented sum of dh per expert instead: kernels/triton_gpt_oss_gate.py), and the in-backward
# updates' per-block squares zeroed and summed once a step (train/backward_updates.py). Their CUDA tests; the gate
# kernels alone (benchmarks/gpt_oss_gate.py); gpt-oss-20b L8 seq 4096 x 2, the flex anchor in the same launch.
#   OUT=/path bash benchmarks/gpu_session15d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 150 tests/test_gpt_oss_gate.py tests/test_backward_updates.py -k "cuda"
timeout 90 python3 benchmarks/gpt_oss_gate.py "$OUT/gpt_oss_gate.json" 2>&1 | grep -vi warn | tail -8 | cut -c1-220
bench_row gpt-oss-20b-L8-s15d $((560 - SECONDS + T0)) --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward,engine_in_backward_adamw8,engine
