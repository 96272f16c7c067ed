#!/usr/bin/env bash
# Session 7's second device run on 1 x H200: LoRA r=16 on attention + experts through the trainer's step on
# the full 48-layer Qwen3-30B-A3B (seq 4096 x 1, blockwise seeded build, without and with activation
# checkpointing; issue 16), then the GPU tests after session 6's moves with their durations (issue 19).
#   OUT=/path bash benchmarks/gpu_session7b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
t0=$SECONDS
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/env.txt" 2>&1
python3 -c 'import torch, transformers, triton; print(torch.__version__, transformers.__version__, triton.__version__)' >> "$OUT/env.txt"
for mode in lora48 lora48_ac; do
  extra=""; [ "$mode" = lora48_ac ] && extra="--ac"
  timeout 100 python3 benchmarks/profile_trainer.py --layers 48 --batch 1 --lora-rank 16 --precision auto --warmup 2 \
    --steps 6 --no-trace $extra --out "$OUT/$mode" > "$OUT/$mode.log" 2>&1
  echo "$mode exit $? after $((SECONDS - t0)) s"; grep -v "^model_type" "$OUT/$mode.log" | tail -4 | cut -c1-900
done
timeout $((560 - SECONDS + t0)) python3 -m pytest -q -rs -p no:cacheprovider --durations=30 "${GPU_TESTS[@]}" > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $? after $((SECONDS - t0)) s"; grep -E "passed|failed|rror|SKIPPED|^[0-9.]+s " "$OUT/pytest-gpu.log" | tail -45
