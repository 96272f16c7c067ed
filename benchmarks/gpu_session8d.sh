#!/usr/bin/env bash
# Session 8, third call (1 x H200, ~5 minutes; carry .whl and .whl-ui): where the LoRA step's time goes (the trainer's
# step, LoRA r=16 on attention + experts, L8 seq 4096 x 1, one profiled window), then the Studio's live tokens/s/GPU
# against the bench's engine row for the L8 4096 x 2 config (issue 15).
#   OUT=/path bash benchmarks/gpu_session8d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 150 python3 benchmarks/profile_trainer.py --layers 8 --batch 1 --lora-rank 16 --precision auto --warmup 3 \
  --steps 10 --out "$OUT/lora8" > "$OUT/lora8.log" 2>&1
echo "lora8 profile exit $? after $((SECONDS - t0)) s"; grep -v "^auto {" "$OUT/lora8.log" | tail -40 | cut -c1-220
grep "^auto {" "$OUT/lora8.log" | cut -c1-600
timeout $((560 - SECONDS + t0)) python3 benchmarks/studio_vs_bench.py --out "$OUT/studio" > "$OUT/studio.log" 2>&1
echo "studio exit $? after $((SECONDS - t0)) s"; tail -5 "$OUT/studio.log"
