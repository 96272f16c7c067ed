#!/usr/bin/env bash
# Session 9, second call (1 x H200, ~8 minutes; carry .whl and .device_commit): the multi-tensor AdamW's compiled test
# (its pinned buffers now on the host whatever torch's default device), then issue 14's memory row: gpt-oss-20b at 8
# layers, the flex_attention anchor, the engine and engine_in_backward in one launch; then Qwen3-30B-A3B L8 with the
# multi-tensor AdamW as the default beside the per-tensor launches and the in-backward updates. At most 8 files come
# back from $OUT: logs and the two bench JSONs only.
#   OUT=/path bash benchmarks/gpu_session9d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 120 python3 -m pytest -x -q -rs -p no:cacheprovider -k cuda tests/test_adamw_multi.py > "$OUT/pytest-multi.log" 2>&1
echo "multi-tensor test exit $? after $((SECONDS - t0)) s"; tail -3 "$OUT/pytest-multi.log" | cut -c1-300
pkill -9 -f "python[0-9.]* -c " 2>/dev/null
mkdir -p "$OUT/bench"
timeout 300 python3 -m workbench.bench --preset gpt-oss-20b --fused-ce --out-dir "$OUT/bench" --no-html \
  --name "$(date +%F)-1xh200-gpt-oss-20b-L8-in-backward" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 30 \
  --rounds 1 --variants anchor_flex,engine,engine_in_backward > "$OUT/bench-gpt-oss.log" 2>&1
echo "bench gpt-oss exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s|^(anchor|engine)" "$OUT/bench-gpt-oss.log" | tail -9
timeout $((585 - SECONDS + t0)) python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" \
  --no-html --name "$(date +%F)-1xh200-qwen3-L8-4096x2-s9b" --layers 8 --seq 4096 --batch 2 --warmup 2 \
  --steps 30 --rounds 1 --variants anchor,engine,engine_adamw_per_tensor,engine_in_backward > "$OUT/bench-qwen3.log" 2>&1
echo "bench qwen3 exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s|^(anchor|engine)" "$OUT/bench-qwen3.log" | tail -12
find "$OUT" -name "*.html" -delete
