#!/usr/bin/env bash
# Ready for the next device session (1 x H200, ~9 minutes; carry .whl and .device_commit): issue 15's other two rows,
# never run with the trainer's step: seq 16384 x 1 at 8 layers, and 16 layers at seq 4096 x 2 (anchor and engine each,
# one launch per shape).
#   OUT=/path bash benchmarks/gpu_session9b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
mkdir -p "$OUT/bench"
timeout 270 python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" --no-html \
  --name "$(date +%F)-1xh200-qwen3-L8-16384x1" --layers 8 --seq 16384 --batch 1 --warmup 2 --steps 30 --rounds 1 \
  --variants anchor,engine > "$OUT/bench-16k.log" 2>&1
echo "bench seq16k exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s" "$OUT/bench-16k.log" | tail -6
timeout $((580 - SECONDS + t0)) python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" \
  --no-html --name "$(date +%F)-1xh200-qwen3-L16-4096x2" --layers 16 --seq 4096 --batch 2 --warmup 2 --steps 30 \
  --rounds 1 --variants anchor,engine > "$OUT/bench-L16.log" 2>&1
echo "bench L16 exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s" "$OUT/bench-L16.log" | tail -6
