#!/usr/bin/env bash
# Session 7's third device run on 1 x H200: Transformers v5 + PEFT LoRA (r=16, attention + experts, gradient
# checkpointing) on the full 48-layer Qwen3-30B-A3B, seq 4096 x 1 (the anchor of gpu_session7b.sh's engine rows;
# issue 16); then `workbench bench` anchor / anchor_liger / engine at L8, seq 4096 x 2, with the one-hash
# stochastic rounding (issue 15), its log timestamped per line.
#   OUT=/path bash benchmarks/gpu_session7c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 100 python3 benchmarks/lora_h200.py peft_ac "$OUT/lora_peft_ac.json" --steps 6 > "$OUT/peft_ac.log" 2>&1
echo "peft_ac exit $? after $((SECONDS - t0)) s"; grep -E "tokens_per_s|peak_gib|error|loss_falls|build_s" "$OUT/lora_peft_ac.json"
mkdir -p "$OUT/bench"
timeout $((540 - SECONDS + t0)) python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" \
  --no-html --name "$(date +%F)-1xh200-qwen3-L8-4096x2-s7" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 30 \
  --rounds 1 --variants anchor,engine,anchor_liger 2>&1 | while IFS= read -r line; do
    printf '%4d %s\n' $((SECONDS - t0)) "$line"; done > "$OUT/bench.log"
echo "bench exit ${PIPESTATUS[0]} after $((SECONDS - t0)) s"
grep -v "Loading weights\|^ *[0-9]* model_type\|Backend impl\|Writing model" "$OUT/bench.log" | tail -30 | cut -c1-250
