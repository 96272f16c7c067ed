#!/usr/bin/env bash
# Session 16's last call (1 x H200; carry .whl and .device_commit): after models/cast.py (bf16 engine models keep
# float32 rotary frequencies), one step's gradients against float32 Transformers again (qwen3 and gpt-oss, 2
# layers, seq 4096), then gpt-oss-20b L8 with every row (the clipping engine row is the README's headline).
#   OUT=/path bash benchmarks/gpu_session16f.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
for preset in qwen3-30b-a3b gpt-oss-20b; do
  timeout 100 python3 benchmarks/grad_parity.py --preset $preset --layers 2 --engines engine \
    --out "$OUT/grad-parity-$preset.json" > "$OUT/grad-parity-$preset.log" 2>&1
  echo "$preset exit $? after $((SECONDS - T0)) s"
  grep -E "^loss|^param|failed|norm.weight|lm_head|embed|layers.1.*(sinks|experts.down|gate.weight|router.weight|q_proj.weight)|Error" \
    "$OUT/grad-parity-$preset.log" | cut -c1-200
done
bench_row gpt-oss-20b-L8-s16f $((420 - SECONDS + T0)) --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine,engine_in_backward_adamw8,engine_in_backward
