#!/usr/bin/env bash
# Session 16's fourth call (1 x H200; carry .whl and .device_commit): one step's gradients at the real shapes
# (benchmarks/grad_parity.py, 2 layers, seq 4096 x 1): the engine and the bf16 anchor each against float32
# Transformers, for gpt-oss-20b (whose bench loss curves part from the anchor's after the first step) and, as the
# control, qwen3-30b-a3b (whose curves track).
#   OUT=/path bash benchmarks/gpu_session16d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
for preset in gpt-oss-20b qwen3-30b-a3b; do
  timeout 240 python3 benchmarks/grad_parity.py --preset $preset --layers 2 --out "$OUT/grad-parity-$preset.json" \
    > "$OUT/grad-parity-$preset.log" 2>&1
  echo "$preset exit $? after $((SECONDS - T0)) s"
  grep -E "^loss|worse|lm_head|embed|layers.1.*(sinks|experts|router|q_proj.weight)|Error" "$OUT/grad-parity-$preset.log" \
    | cut -c1-200
done
