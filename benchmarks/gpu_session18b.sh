#!/usr/bin/env bash
# Session 18's second call (1 x H200; carry .whl, .device_commit and .ab with 696579b's workbench/ in .ab/old): cuDNN's
# attention backward with its dP workspace allowed (benchmarks/cudnn_dp_workspace.py, Qwen3's 4096 x 2 and 16384 x 1),
# the trainer's step with it (profile_trainer.py, the env var set), the CE/extras CUDA tests, and a same-machine A/B
# of the CE changes (old/new alternating, twice).
#   OUT=/path bash benchmarks/gpu_session18b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 200 python3 benchmarks/cudnn_dp_workspace.py --out "$OUT/cudnn_dp.json" 2>&1 | cut -c1-400
gpu_tests 150 tests/test_kernels.py tests/test_generic_extras.py -k "ce or cross or scale or router_modules"
ab_rounds 2 --layers 8 --precision auto --no-trace --steps 20
for limit in 4294967296; do
  CUDNN_FRONTEND_ATTN_DP_WORKSPACE_LIMIT=$limit timeout 150 python3 benchmarks/profile_trainer.py --layers 8 \
    --precision auto --no-trace --steps 20 --out "$OUT/dp-$limit" > "$OUT/dp-$limit.log" 2>&1
  echo "dp limit $limit: $(grep -oE '"step_ms_queued": [0-9.]+' "$OUT/dp-$limit.log") $(grep -oE '"records_median_ms": \{[^}]*\}' "$OUT/dp-$limit.log") $(grep -oE '"peak_gib": [0-9.]+' "$OUT/dp-$limit.log" | head -1)"
done
