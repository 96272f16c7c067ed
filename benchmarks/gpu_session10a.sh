#!/usr/bin/env bash
# Session 10, first call after 9h (1 x H200, ~7 minutes; carry .whl and .device_commit): the CUDA-graph tests again
# (9h: 6 failed on one stale assertion, the eager reason's wording; everything before it held), then issue 15's L16 row
# at seq 4096 x 2 (anchor, engine, engine_cuda_graphs in one launch), never run with the trainer's step.
#   OUT=/path bash benchmarks/gpu_session10a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider tests/test_stack_graphs.py > "$OUT/pytest.log" 2>&1
echo "tests exit $? after $((SECONDS - t0)) s"; tail -2 "$OUT/pytest.log" | cut -c1-300
grep -E "^E " "$OUT/pytest.log" | head -4 | cut -c1-300
pkill -9 -f "python[0-9.]* -c " 2>/dev/null
mkdir -p "$OUT/bench"
timeout $((560 - SECONDS + t0)) python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" \
  --no-html --name "$(date +%F)-1xh200-qwen3-L16-4096x2" --layers 16 --seq 4096 --batch 2 --warmup 2 --steps 30 \
  --rounds 1 --variants anchor,engine,engine_cuda_graphs > "$OUT/bench-L16.log" 2>&1
echo "bench L16 exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s" "$OUT/bench-L16.log" | tail -8
