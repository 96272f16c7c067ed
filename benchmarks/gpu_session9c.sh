#!/usr/bin/env bash
# Ready for the next device session (1 x H200, ~8 minutes; carry .whl and .device_commit): the memory of updates inside
# the backward (train.optimizer_in_backward, issue 14's GPT-OSS goal <= 0.6x the flex anchor's memory): gpt-oss-20b
# at 8 layers, the flex_attention anchor, the engine and engine_in_backward in one launch; then Qwen3-30B-A3B L8.
#   OUT=/path bash benchmarks/gpu_session9c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
mkdir -p "$OUT/bench"
timeout 330 python3 -m workbench.bench --preset gpt-oss-20b --fused-ce --out-dir "$OUT/bench" --no-html \
  --name "$(date +%F)-1xh200-gpt-oss-20b-L8-in-backward" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 30 \
  --rounds 1 --variants anchor_flex,engine,engine_in_backward > "$OUT/bench-gpt-oss.log" 2>&1
echo "bench gpt-oss exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s" "$OUT/bench-gpt-oss.log" | tail -8
timeout $((580 - SECONDS + t0)) python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" \
  --no-html --name "$(date +%F)-1xh200-qwen3-L8-4096x2-in-backward" --layers 8 --seq 4096 --batch 2 --warmup 2 \
  --steps 30 --rounds 1 --variants anchor,engine,engine_in_backward > "$OUT/bench-qwen3.log" 2>&1
echo "bench qwen3 exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s" "$OUT/bench-qwen3.log" | tail -8
