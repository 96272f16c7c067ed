#!/usr/bin/env bash
# Session 7's first full device run on 1 x H200 (each step under its own time limit, most important first):
# the GPU kernel/parity/packing/compiled-AdamW tests after session 6's moves (issue 19); `workbench bench`
# anchor / anchor_liger / engine at Qwen3-30B-A3B L8, seq 4096 x 2 with the one-hash stochastic rounding
# (issue 15); the trainer's step with LoRA r=16 on attention + experts, profiled, L8 seq 4096 x 1 (issue 16);
# the AdamW modes over the model's tensors.
#   OUT=/path bash benchmarks/gpu_session7.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 150 python3 -m pytest -q -rs -p no:cacheprovider "${GPU_TESTS[@]}" \
  > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $((SECONDS - t0)) s"; tail -12 "$OUT/pytest-gpu.log"
mkdir -p "$OUT/bench"
timeout 250 python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" --no-html \
  --name "$(date +%F)-1xh200-qwen3-L8-4096x2-s7" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 30 --rounds 1 \
  --variants anchor,anchor_liger,engine > "$OUT/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - t0)) s"; grep -v "Loading weights\|^model_type\|Backend impl" "$OUT/bench.log" | tail -22
timeout 110 python3 benchmarks/profile_trainer.py --layers 8 --batch 1 --lora-rank 16 --precision bf16 --warmup 2 \
  --steps 5 --out "$OUT/prof-lora" > "$OUT/prof-lora.log" 2>&1
echo "lora profile exit $? after $((SECONDS - t0)) s"; grep -v "^model_type" "$OUT/prof-lora.log" | tail -40 | cut -c1-400
(cd benchmarks && timeout 70 python3 adamw_modes.py --out "$OUT/adamw-modes.json" 2>&1 | grep -v "^model_type" | tail -8)
echo "all done after $((SECONDS - t0)) s"
