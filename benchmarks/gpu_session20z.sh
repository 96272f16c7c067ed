#!/usr/bin/env bash
# Session 20's last device call: two more rounds of this tree's step with embedding and router torch against both
# 'triton' (expert_wgrad autograd), to decide their `auto`. Carry .whl and .device_commit.
#   OUT=/path bash benchmarks/gpu_session20z.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
ab_sides 2 rows="new,--expert-wgrad autograd --embedding torch --router torch" \
  rows_kernels="new,--expert-wgrad autograd --embedding triton --router triton" \
  -- --layers 8 --precision auto --no-trace --steps 20
find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ab-*' -exec rm -rf {} +
