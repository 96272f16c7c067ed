#!/usr/bin/env bash
# Ready for the next session's first call (1 x H200; carry .whl with `datasets` and its missing dependencies, see
# the device README, and .device_commit): the GPU tests (gpu_env.sh's list, now with the sink attention, the GPT-OSS
# gate and the in-backward updates, whose trainer cases read the demo's JSONL through `datasets`), then issue 14's
# gpt-oss row twice on one machine (session 15 measured 2.01x, 1.96x and 1.98x at 0.53x on three machines).
#   OUT=/path bash benchmarks/gpu_session16a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 200 "${GPU_TESTS[@]}" -k "cuda or rope"
for run in 1 2; do
  bench_row "gpt-oss-20b-L8-s16a-$run" $(((560 - SECONDS + T0) / (3 - run))) --preset gpt-oss-20b --layers 8 --seq 4096 \
    --batch 2 --variants anchor_flex,engine_in_backward_adamw8,engine_in_backward
done
