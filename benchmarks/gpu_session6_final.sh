#!/usr/bin/env bash
# Session 6's last device run on 1 x H200, after the merges (issue 19: behaviour unchanged on the GPU): the GPU
# kernel, parity and packing tests; `workbench bench` anchor / anchor_liger / engine at Qwen3-30B-A3B L8, seq 4096 x 2
# (the merged trainer step, same launch anchors); the quickstart's loss on the real architecture (issue 18 item 13).
#   OUT=/path bash benchmarks/gpu_session6_final.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 240 python3 -m pytest -q -rs -p no:cacheprovider "${GPU_TESTS[@]}" \
  > "$OUT/pytest-gpu.log" 2>&1
echo "pytest exit $?"; tail -15 "$OUT/pytest-gpu.log"
mkdir -p "$OUT/bench"
timeout 210 python3 -m workbench.bench --preset qwen3-30b-a3b --fused-ce --out-dir "$OUT/bench" --no-html \
  --name "$(date +%F)-1xh200-qwen3-L8-4096x2-final" --layers 8 --seq 4096 --batch 2 --warmup 2 --steps 20 --rounds 1 \
  --variants anchor,anchor_liger,engine 2>&1 | grep -v "Loading weights\|^model_type" | tail -14
timeout 130 python3 benchmarks/quickstart_loss.py --out "$OUT/quickstart-loss" 2>&1 | tail -8
