#!/usr/bin/env bash
# Where the product's training step spends its time, and whether it computes what Transformers computes:
#   profile-qwen3-L8     benchmarks/profile_trainer.py: Qwen3-30B-A3B L8, seq 4096 x 2, Trainer.train_step at the
#                        default precision: queued step time, phase records, device time by kernel, the GPU's idle
#                        time a step (--idle) and a gzipped Chrome trace
#   grad-parity-*        benchmarks/grad_parity.py: one step's loss and gradients at the real shapes (2 layers, seq
#                        4096) of the engine and of Transformers' own bf16 model, each against float32 Transformers
#   trainer-async        benchmarks/trainer_async_check.py: the host syncs left in a non-logging step, the skip flag
#   studio-vs-bench      benchmarks/studio_vs_bench.py: the Studio's live tokens/s/GPU against the bench's engine row
#                        for the same config (needs the lab extras: ipyparallel and its Jupyter packages)
# Writes $OUT/step/<date>-1x<card>-<what>-<commit>[.json]. About 10 minutes.
#   OUT=/tmp/step bash benchmarks/suites/trainer_step.sh
source "$(dirname "$0")/common.sh"
mkdir -p "$OUT/step"
NAME="$DAY-1x$CARD"
step profile-qwen3-L8 "$PY" benchmarks/profile_trainer.py --layers 8 --precision auto --idle --steps 20 \
  --out "$OUT/step/$NAME-profile-qwen3-30b-a3b-L8-4096x2$TAG"
for preset in qwen3-30b-a3b gpt-oss-20b; do
  step "grad-parity-$preset" "$PY" benchmarks/grad_parity.py --preset "$preset" --layers 2 --engines engine \
    --out "$OUT/step/$NAME-grad-parity-$preset-L2-4096x1$TAG.json"
done
step trainer-async "$PY" benchmarks/trainer_async_check.py
step studio-vs-bench "$PY" benchmarks/studio_vs_bench.py --out "$OUT/step/$NAME-studio-vs-bench-qwen3-30b-a3b-L8-4096x2$TAG"
finish
