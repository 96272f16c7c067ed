#!/usr/bin/env bash
# Session 8, second call (1 x H200, ~6 minutes): the multi-tensor AdamW's compiled-kernel test (its first run failed
# on CUDA: the step table was built on torch's default device, which the test sets to CUDA, and only a host tensor
# pins), then issue 16's rows in one launch with nothing else on the GPU (the first call's pytest was cut by its
# timeout and left its Triton subprocesses running beside the LoRA rows), then the rest of the GPU test list.
#   OUT=/path bash benchmarks/gpu_session8c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
leftovers() {  # a cut pytest leaves its subprocesses: stop them before anything is timed
  pkill -9 -f "pytest" 2>/dev/null; pkill -9 -f "python[0-9.]* -c " 2>/dev/null; sleep 2
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv,noheader | tee -a "$OUT/gpu-apps.log"
}
timeout 150 python3 -m pytest -x -q -rs -p no:cacheprovider -k cuda tests/test_adamw_multi.py > "$OUT/pytest-multi.log" 2>&1
echo "multi-tensor test exit $? after $((SECONDS - t0)) s"; tail -30 "$OUT/pytest-multi.log" | cut -c1-400
leftovers
timeout 100 python3 benchmarks/lora_h200.py peft_ac "$OUT/lora_peft_ac.json" --steps 6 > "$OUT/peft_ac.log" 2>&1
echo "peft_ac exit $? after $((SECONDS - t0)) s"; grep -E "tokens_per_s|peak_gib|error|loss_falls|losses" -A0 "$OUT/lora_peft_ac.json"
for multi in 4194304 0; do
  leftovers
  timeout 100 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
    --steps 10 --no-trace --adamw-multi-numel "$multi" --out "$OUT/lora48-multi$multi" > "$OUT/lora48-multi$multi.log" 2>&1
  echo "lora48 multi=$multi exit $? after $((SECONDS - t0)) s"; grep "^auto" "$OUT/lora48-multi$multi.log" | cut -c1-900
done
leftovers
rest=(); for t in "${GPU_TESTS[@]}"; do [ "$t" = tests/test_adamw_multi.py ] || rest+=("$t"); done
timeout $((570 - SECONDS + t0)) python3 -m pytest -q -rs -p no:cacheprovider --durations=10 "${rest[@]}" \
  > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $((SECONDS - t0)) s"; grep -E "passed|failed|rror|SKIPPED|^FAILED" "$OUT/pytest-gpu.log" | tail -25
leftovers
