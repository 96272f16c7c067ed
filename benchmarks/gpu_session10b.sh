#!/usr/bin/env bash
# Session 10, second call (1 x H200, ~5 minutes; carry .whl and .device_commit): test_stack_graphs on the fixed
# assertions, then where the trainer's step goes for Moonlight L8 and Qwen3 L8 (seq 4096 x 2, the engine's defaults),
# with the device time by aten call and shapes (names the generic elementwise kernels). Traces stay in /tmp.
#   OUT=/path bash benchmarks/gpu_session10b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 150 tests/test_stack_graphs.py
for preset in moonlight-16b-a3b qwen3-30b-a3b; do
  timeout 150 python3 benchmarks/profile_trainer.py --preset $preset --layers 8 --precision auto --warmup 3 --steps 8 \
    --out /tmp/prof-$preset > "$OUT/prof-$preset.log" 2>&1
  echo "$preset exit $? after $((SECONDS - T0)) s"; grep -E "^auto" "$OUT/prof-$preset.log" | cut -c1-400
  cp /tmp/prof-$preset/profile-trainer.json "$OUT/prof-$preset.json"
done
