#!/usr/bin/env bash
# Session 8, last call (1 x H200, ~8 minutes; carry .whl): issue 16's rows in one launch (the engine's trainer step,
# LoRA r=16 on attention + experts, the full 48-layer Qwen3-30B-A3B at seq 4096 x 1, with Python's collector paused
# (train.gc_every 50, the default) and not (0), beside Transformers v5 + PEFT with gradient checkpointing), then the
# bench at Qwen3-30B-A3B L8 seq 4096 x 2 (issue 15: anchor, engine, engine_balanced, anchor_liger; Liger compiles
# ~4 minutes on a fresh machine, so it runs last).
#   OUT=/path bash benchmarks/gpu_session8e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | tee "$OUT/gpu-apps.log"
lora48() {  # name, gc_every
  timeout 100 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
    --steps 10 --no-trace --gc-every "$2" --out "$OUT/$1" > "$OUT/$1.log" 2>&1
  echo "$1 exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/$1.log" | cut -c1-900
}
lora48 lora48-gc50-a 50
timeout 100 python3 benchmarks/lora_h200.py peft_ac "$OUT/lora_peft_ac.json" --steps 6 > "$OUT/peft_ac.log" 2>&1
echo "peft_ac exit $? after $((SECONDS - t0)) s"; grep -E "tokens_per_s|peak_gib|error|loss_falls" "$OUT/lora_peft_ac.json"
lora48 lora48-gc0 0
lora48 lora48-gc50-b 50
mkdir -p "$OUT/bench"
timeout $((585 - SECONDS + t0)) python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" \
  --no-html --name "$(date +%F)-1xh200-qwen3-L8-4096x2-s8" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 30 \
  --rounds 1 --variants anchor,engine,engine_balanced,anchor_liger > "$OUT/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s|^(anchor|engine)" "$OUT/bench.log" | tail -14
