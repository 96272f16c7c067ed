#!/usr/bin/env bash
# The README's bench table: one `workbench bench` launch per setup the table shows, each timing the product's step
# (Trainer.train_step: clipping, schedule, metrics, synthetic data) for the engine AND its Transformers v5 anchor in
# the same launch, from the same initial weights and tokens; 2 warm-up + 30 timed steps, one round, the engine with
# the product's defaults (the fused cross-entropy among them). Launches (ONLY="name ..." runs some):
#   qwen3-30b-a3b-L8-4096x2      anchor, engine (LIGER=1 adds anchor_liger: Transformers v5 + liger-kernel)
#   qwen3-30b-a3b-L16-4096x2     anchor, engine (the anchor peaks at ~99 GiB: on an 80 GB card its row fails)
#   qwen3-30b-a3b-L8-16384x1     anchor, engine
#   gpt-oss-20b-L8-4096x2        anchor_flex, engine, engine_in_backward, engine_in_backward_adamw8
#   moonlight-16b-a3b-L8-4096x2  anchor, engine
#   2gpu-qwen3-30b-a3b-L16-4096x2  with 2 or more GPUs: anchor, engine, engine_balanced over 2 ranks (torchrun)
# Each writes $OUT/results/<date>-<N>x<card>-<launch>-<commit>.json (schema workbench.bench/2: device, versions,
# commit, command, every row's tokens/s, p10-p90, peak memory, SM clock and energy). About 25 minutes on one H200.
#   OUT=/tmp/readme bash benchmarks/suites/readme_tables.sh
# Then copy the JSONs into benchmarks/results/ and regenerate both tables:
#   workbench bench --readme-table --write README.md && workbench bench --history-table --write benchmarks/HISTORY.md
source "$(dirname "$0")/common.sh"
mkdir -p "$OUT/results"

# launch NAME RANKS ARGS...: one bench launch named after what it measures.
launch() {
  local name=$1 ranks=$2 runner=("$PY" -m workbench.bench)
  shift 2
  selected "$name" || return 0
  if [ "$ranks" -gt 1 ]; then
    runner=("$PY" -m torch.distributed.run --standalone --nproc-per-node "$ranks" -m workbench.bench)
  fi
  step "$name" "${runner[@]}" --warmup 2 --steps 30 --rounds 1 --out-dir "$OUT/results" --no-html \
    --name "$DAY-${ranks}x$CARD-${name#2gpu-}$TAG" "$@"
  grep -E "x tokens/s|^gpu clocks" "$OUT/logs/$name.log" | cut -c1-200
}

QWEN_L8_VARIANTS="anchor,engine${LIGER:+,anchor_liger}"
launch qwen3-30b-a3b-L8-4096x2 1 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 --variants "$QWEN_L8_VARIANTS"
launch qwen3-30b-a3b-L16-4096x2 1 --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 --variants anchor,engine
launch qwen3-30b-a3b-L8-16384x1 1 --preset qwen3-30b-a3b --layers 8 --seq 16384 --batch 1 --variants anchor,engine
launch gpt-oss-20b-L8-4096x2 1 --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine,engine_in_backward,engine_in_backward_adamw8
launch moonlight-16b-a3b-L8-4096x2 1 --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
if [ "$GPUS" -ge 2 ]; then
  launch 2gpu-qwen3-30b-a3b-L16-4096x2 2 --preset qwen3-30b-a3b --layers 16 --seq 4096 --batch 2 \
    --variants anchor,engine,engine_balanced
fi
finish
