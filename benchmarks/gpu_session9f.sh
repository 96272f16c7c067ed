#!/usr/bin/env bash
# Session 9, fourth call (1 x H200, ~7 minutes; carry .whl and .device_commit): the decoder stack as CUDA graphs
# (train.cuda_graphs, train/stack_graphs.py). Its CUDA tests (replayed steps equal to eager ones, LoRA and full), then
# the 48-layer LoRA step eager / graphed in alternating order beside Transformers v5 + PEFT in the same launch (issue
# 16), then the L8 bench's anchor, engine and engine_cuda_graphs rows (issue 15). At most 8 files come back.
#   OUT=/path bash benchmarks/gpu_session9f.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 150 python3 -m pytest -x -q -rs -p no:cacheprovider tests/test_stack_graphs.py > "$OUT/pytest-graphs.log" 2>&1
rc=$?; echo "stack graphs tests exit $rc after $((SECONDS - t0)) s"; tail -25 "$OUT/pytest-graphs.log" | cut -c1-400
[ $rc -eq 0 ] || exit 0  # the capture fails: nothing below would measure it
pkill -9 -f "python[0-9.]* -c " 2>/dev/null
lora48() {  # name, extra flags
  echo "== $1" >> "$OUT/lora.log"
  timeout 90 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
    --steps 10 --no-trace --out "/tmp/$1" "${@:2}" >> "$OUT/lora.log" 2>&1
  echo "$1 exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/lora.log" | tail -1 | cut -c1-700
}
lora48 lora48-eager-a
lora48 lora48-graphs-a --cuda-graphs
timeout 60 python3 benchmarks/lora_h200.py peft_ac "$OUT/lora_peft_ac.json" --steps 6 >> "$OUT/lora.log" 2>&1
echo "peft_ac exit $? after $((SECONDS - t0)) s"; grep -E "tokens_per_s|peak_gib|loss_falls" "$OUT/lora_peft_ac.json"
lora48 lora48-graphs-b --cuda-graphs
lora48 lora48-eager-b
grep -E "Error|error" "$OUT/lora.log" | head -5 | cut -c1-400
mkdir -p "$OUT/bench"
timeout $((585 - SECONDS + t0)) python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" \
  --no-html --name "$(date +%F)-1xh200-qwen3-L8-4096x2-graphs" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 30 \
  --rounds 1 --variants anchor,engine,engine_cuda_graphs > "$OUT/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s|^(anchor|engine)" "$OUT/bench.log" | tail -9
grep -E "Error" "$OUT/bench.log" | head -3 | cut -c1-400
find "$OUT" -name "*.html" -delete
