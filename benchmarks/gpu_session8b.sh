#!/usr/bin/env bash
# Ready for the next device session (1 x H200, ~9 minutes; carry .whl and .whl-ui): `workbench bench` at
# Qwen3-30B-A3B L8 seq 4096 x 2 (anchor, engine, engine_balanced, anchor_liger: Liger's kernels compile for ~4
# minutes on a fresh machine, so it runs last), then the Studio's live figure against the bench's (issue 15).
#   OUT=/path bash benchmarks/gpu_session8b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
mkdir -p "$OUT/bench"
timeout 380 python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" --no-html \
  --name "$(date +%F)-1xh200-qwen3-L8-4096x2-s8" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 30 --rounds 1 \
  --variants anchor,engine,engine_balanced,anchor_liger > "$OUT/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s|^(anchor|engine)" "$OUT/bench.log" | tail -14
timeout $((560 - SECONDS + t0)) python3 benchmarks/studio_vs_bench.py --out "$OUT/studio" > "$OUT/studio.log" 2>&1
echo "studio exit $? after $((SECONDS - t0)) s"; tail -3 "$OUT/studio.log"
