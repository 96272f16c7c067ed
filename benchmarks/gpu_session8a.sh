#!/usr/bin/env bash
# Ready for the next device session (1 x H200, ~6 minutes): the multi-tensor AdamW's compiled kernel against the
# per-tensor one (tests/test_adamw_multi.py on CUDA) and the GPU test list; then issue 16's rows in one launch:
# Transformers v5 + PEFT (gradient checkpointing) and the engine's trainer step, LoRA r=16 on attention + experts,
# the full 48-layer Qwen3-30B-A3B at seq 4096 x 1, with one AdamW launch per tensor and with the multi-tensor one.
#   OUT=/path bash benchmarks/gpu_session8a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider --durations=15 "${GPU_TESTS[@]}" > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $((SECONDS - t0)) s"; grep -E "passed|failed|rror|SKIPPED" "$OUT/pytest-gpu.log" | tail -20
timeout 100 python3 benchmarks/lora_h200.py peft_ac "$OUT/lora_peft_ac.json" --steps 6 > "$OUT/peft_ac.log" 2>&1
echo "peft_ac exit $? after $((SECONDS - t0)) s"; grep -E "tokens_per_s|peak_gib|error|loss_falls" "$OUT/lora_peft_ac.json"
for multi in 0 4194304; do
  timeout 100 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
    --steps 6 --no-trace --adamw-multi-numel "$multi" --out "$OUT/lora48-multi$multi" > "$OUT/lora48-multi$multi.log" 2>&1
  echo "lora48 multi=$multi exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/lora48-multi$multi.log" | cut -c1-700
done
