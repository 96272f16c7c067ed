#!/usr/bin/env bash
# Ready for the next device session (1 x H200, ~7 minutes; carry .whl and .device_commit). Is the multi-tensor AdamW
# a win once its step table goes through buffers allocated once (kernels/triton_adamw_multi.py _ListState; session 8
# measured the per-step pin_memory() version slower)? Its compiled-kernel test first, then the 48-layer LoRA step
# (issue 16) with it off and on in alternating order beside Transformers v5 + PEFT in the same launch, then the L8
# bench's anchor and engine rows (issue 15: is the default step back at session 7's 127 ms?).
#   OUT=/path bash benchmarks/gpu_session9a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
timeout 120 python3 -m pytest -x -q -rs -p no:cacheprovider -k cuda tests/test_adamw_multi.py > "$OUT/pytest-multi.log" 2>&1
echo "multi-tensor test exit $? after $((SECONDS - t0)) s"; tail -15 "$OUT/pytest-multi.log" | cut -c1-300
pkill -9 -f "python[0-9.]* -c " 2>/dev/null
lora48() {  # name, adamw multi-tensor numel
  timeout 60 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
    --steps 10 --no-trace --adamw-multi-numel "$2" --out "$OUT/$1" > "$OUT/$1.log" 2>&1
  echo "$1 exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/$1.log" | cut -c1-520
}
lora48 lora48-multi0-a 0
lora48 lora48-multi4m-a 4194304
timeout 60 python3 benchmarks/lora_h200.py peft_ac "$OUT/lora_peft_ac.json" --steps 6 > "$OUT/peft_ac.log" 2>&1
echo "peft_ac exit $? after $((SECONDS - t0)) s"; grep -E "tokens_per_s|peak_gib|loss_falls" "$OUT/lora_peft_ac.json"
lora48 lora48-multi4m-b 4194304
lora48 lora48-multi0-b 0
mkdir -p "$OUT/bench"
timeout $((580 - SECONDS + t0)) python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" \
  --no-html --name "$(date +%F)-1xh200-qwen3-L8-4096x2-s9" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 30 \
  --rounds 1 --variants anchor,engine > "$OUT/bench.log" 2>&1
echo "bench exit $? after $((SECONDS - t0)) s"; grep -E "^bench:|x tokens/s|^(anchor|engine)" "$OUT/bench.log" | tail -8
