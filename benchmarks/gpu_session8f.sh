#!/usr/bin/env bash
# Session 8, a short call (1 x H200, ~2.5 minutes): the 48-layer LoRA step with the multi-tensor AdamW off and on
# beside Transformers v5 + PEFT in one launch (gpu_session8e.sh's rows ran 8.2k tokens/s with it on where call c
# ran 10.6k with it off: is it the multi-tensor launch?).
#   OUT=/path bash benchmarks/gpu_session8f.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
lora48() {  # name, adamw multi-tensor numel
  timeout 55 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
    --steps 8 --no-trace --adamw-multi-numel "$2" --out "$OUT/$1" > "$OUT/$1.log" 2>&1
  echo "$1 exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/$1.log" | cut -c1-520
}
lora48 lora48-multi0 0
timeout 45 python3 benchmarks/lora_h200.py peft_ac "$OUT/lora_peft_ac.json" --steps 5 > "$OUT/peft_ac.log" 2>&1
echo "peft_ac exit $? after $((SECONDS - t0)) s"; grep -E "tokens_per_s|peak_gib|loss_falls" "$OUT/lora_peft_ac.json"
lora48 lora48-multi4m 4194304
