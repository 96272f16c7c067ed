#!/usr/bin/env bash
# The README's LoRA figures: LoRA r 16, alpha 32 on attention and the experts of the full Qwen3-30B-A3B architecture
# (48 layers, random-init bf16 base), seq 4096 x 1. The engine is timed in the product's step
# (benchmarks/profile_trainer.py: Trainer.train_step, CUDA events over 10 queued steps after 2 warm-up), with
# train.cuda_graphs and eagerly; Transformers v5 + PEFT with gradient checkpointing (benchmarks/lora_h200.py peft_ac;
# without checkpointing PEFT runs out of memory) in the same launch, on the same model, shape and targets. Order:
#   graphs-falls  graphs on one repeated batch at lr 1e-4, as the PEFT row trains (the loss must fall)
#   graphs-a, eager-a, peft_ac, eager-b, graphs-b   alternating, so drift of the card shows
# The engine's steps peak at ~89.5 GiB (the graph pool included): on an 80 GB card set LAYERS=24. PEFT must be
# installed (`pip install peft`). Writes $OUT/lora/<date>-1x<card>-qwen3-30b-a3b-L48-lora-r16-4096x1-<commit>/ with
# one folder per engine row (profile-trainer.json) and peft_ac.json, then prints the rows. About 8 minutes.
#   OUT=/tmp/lora bash benchmarks/suites/lora.sh
source "$(dirname "$0")/common.sh"
LAYERS="${LAYERS:-48}"
DIR="$OUT/lora/$DAY-1x$CARD-qwen3-30b-a3b-L$LAYERS-lora-r16-4096x1$TAG"
mkdir -p "$DIR"

engine() {  # LABEL EXTRA_ARGS...
  local label=$1
  shift
  step "lora-$label" "$PY" benchmarks/profile_trainer.py --layers "$LAYERS" --batch 1 --lora-rank 16 \
    --precision auto --warmup 2 --steps 10 --no-trace --out "$DIR/$label" "$@"
}

engine graphs-falls --cuda-graphs --repeat-batch --lr 1e-4
engine graphs-a --cuda-graphs
engine eager-a
step lora-peft_ac "$PY" benchmarks/lora_h200.py peft_ac "$DIR/peft_ac.json" --layers "$LAYERS" --steps 6
engine eager-b
engine graphs-b --cuda-graphs
"$PY" - "$DIR" <<'PY'
import json, sys
from pathlib import Path

for path in sorted(Path(sys.argv[1]).glob("*/profile-trainer.json")) + sorted(Path(sys.argv[1]).glob("*.json")):
    data = json.loads(path.read_text())
    row = data["modes"][0] if "modes" in data else data
    peak = row.get("step_peak_gib") or row.get("peak_gib")
    loss = row.get("losses") or []
    print(f"{path.parent.name if 'modes' in data else path.stem:14s} {row.get('tokens_per_s', 0):9,.0f} tokens/s"
          f"  peak {peak or 0:5.1f} GiB  loss {loss[0] if loss else '-'} -> {loss[-1] if loss else '-'}"
          f"  {row.get('error', '')[:120]}")
PY
finish
