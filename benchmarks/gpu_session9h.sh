#!/usr/bin/env bash
# Session 9, last call (1 x H200, ~2 minutes; carry .whl and .device_commit): the CUDA-graph tests again (a handed-on
# layer's input needs a gradient under LoRA where layer 0's does not: 9g refused it as "another shape"), then the
# 48-layer LoRA step replayed as graphs on lora_h200.py's setting (one batch, lr 1e-4: does the loss fall?).
#   OUT=/path bash benchmarks/gpu_session9h.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 70 python3 -m pytest -x -q -rs -p no:cacheprovider tests/test_stack_graphs.py > "$OUT/pytest-graphs.log" 2>&1
echo "stack graphs tests exit $? after $((SECONDS - t0)) s"; tail -3 "$OUT/pytest-graphs.log" | cut -c1-300
grep -E "^E " "$OUT/pytest-graphs.log" | head -4 | cut -c1-300
pkill -9 -f "python[0-9.]* -c " 2>/dev/null
timeout 75 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
  --steps 12 --no-trace --cuda-graphs --repeat-batch --lr 1e-4 --out /tmp/lora-falls > "$OUT/lora.log" 2>&1
echo "lora48 graphs repeat-batch lr 1e-4 exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/lora.log" | cut -c1-900
grep -E "Error" "$OUT/lora.log" | head -3 | cut -c1-300
