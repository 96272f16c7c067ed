#!/usr/bin/env bash
# Session 15's fifth call (1 x H200; carry .device_commit): the segmented bias sums split 8 ways per expert (uneven
# routing made the busiest expert the kernel's time: the down bias's fwd+bwd 0.56 ms in gpu_session15d.sh). The
# gate's CUDA test, the gate kernels alone, gpt-oss-20b L8 seq 4096 x 2 with the flex anchor in the same launch.
#   OUT=/path bash benchmarks/gpu_session15e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 60 tests/test_gpt_oss_gate.py -k "cuda"
timeout 60 python3 benchmarks/gpt_oss_gate.py "$OUT/gpt_oss_gate.json" 2>&1 | grep -E "speedup|fwd_bwd_ms" | tr -d ' \n'
echo
bench_row gpt-oss-20b-L8-s15e $((420 - SECONDS + T0)) --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward,engine_in_backward_adamw8
