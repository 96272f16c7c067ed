#!/usr/bin/env bash
# Session 9, fifth call (1 x H200, ~7 minutes; carry .whl and .device_commit): the CUDA-graph tests over five
# families; the 48-layer LoRA step replayed as graphs on lora_h200.py's setting (one batch, lr 1e-4: does the loss
# fall?); issue 14's Moonlight L8 row with engine_cuda_graphs beside it and gpt-oss's least-memory row
# (engine_in_backward_ac); issue 15's seq 16384 x 1 row. At most 8 files come back: logs and bench JSONs.
#   OUT=/path bash benchmarks/gpu_session9g.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 100 python3 -m pytest -x -q -rs -p no:cacheprovider tests/test_stack_graphs.py > "$OUT/pytest-graphs.log" 2>&1
echo "stack graphs tests exit $? after $((SECONDS - t0)) s"; tail -4 "$OUT/pytest-graphs.log" | cut -c1-300
grep -E "^E |Error" "$OUT/pytest-graphs.log" | head -6 | cut -c1-300
pkill -9 -f "python[0-9.]* -c " 2>/dev/null
timeout 80 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
  --steps 12 --no-trace --cuda-graphs --repeat-batch --lr 1e-4 --out /tmp/lora-falls > "$OUT/lora.log" 2>&1
echo "lora48 graphs repeat-batch lr 1e-4 exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/lora.log" | cut -c1-900
mkdir -p "$OUT/bench"
bench() {  # name, limit, args...
  echo "== $1" >> "$OUT/bench.log"
  timeout "$2" python3 -m workbench.bench --fused-ce --out-dir "$OUT/bench" --no-html --name "$(date +%F)-1xh200-$1" \
    --warmup 2 --steps 30 --rounds 1 "${@:3}" >> "$OUT/bench.log" 2>&1
  echo "bench $1 exit $? after $((SECONDS - t0)) s"
  sed -n "/== $1/,\$p" "$OUT/bench.log" | grep -E "^bench: [a-z_]+:|x tokens/s|failed" | cut -c1-260
}
bench moonlight-L8-graphs 150 --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
bench gpt-oss-20b-L8-least-memory 130 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine_in_backward_ac
bench qwen3-L8-16384x1 $((575 - SECONDS + t0)) --preset qwen3-30b-a3b --layers 8 --seq 16384 --batch 1 \
  --variants anchor,engine
find "$OUT" -name "*.html" -delete
