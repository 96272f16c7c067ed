#!/usr/bin/env bash
# The hybrid models (Mamba2 or Gated DeltaNet layers beside MoE and attention) with the engine's chunked sequence
# mixers (BackendConfig.mixer, compiled by torch.compile on CUDA):
#   mixer-tests                       tests/test_mixers.py on the GPU: the CPU parity tests (float32 against
#                                     Transformers' torch path), the compiled mixers against the eager math (float32
#                                     values and gradients) and packed documents kept apart in bf16
#   nemotron-3-nano-30b-a3b-L8-4096x1 `workbench bench`: anchor (Transformers v5), engine (chunked mixers),
#                                     engine_transformers_mixer (the engine with Transformers' mixers)
#   qwen3.5-35b-a3b-L8-4096x1         the same rows for Qwen3.5-35B-A3B (6 Gated DeltaNet + 2 attention layers)
#   qwen3-next-80b-a3b-L8-4096x1      the same rows for Qwen3-Next-80B-A3B (only when ONLY names it: 512 experts)
# Writes $OUT/results/<date>-1x<card>-<launch>-<commit>.json. The first launch of each model compiles its mixers
# (a minute or two; inductor's cache in /tmp keeps them for later launches on the same machine). ONLY="name ..."
# runs some, e.g. two calls of under 10 minutes each:
#   OUT=/tmp/hybrids ONLY=mixer-tests bash benchmarks/suites/hybrids.sh
#   OUT=/tmp/hybrids ONLY="nemotron-3-nano-30b-a3b-L8-4096x1 qwen3.5-35b-a3b-L8-4096x1" bash benchmarks/suites/hybrids.sh
source "$(dirname "$0")/common.sh"
mkdir -p "$OUT/results"

step mixer-tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/test_mixers.py
[ -f "$OUT/logs/mixer-tests.log" ] && tail -3 "$OUT/logs/mixer-tests.log"

# launch NAME ARGS...: one bench launch of one rank, named after what it measures.
launch() {
  local name=$1
  shift
  selected "$name" || return 0
  step "$name" "$PY" -m workbench.bench --warmup 2 --steps 10 --rounds 1 --out-dir "$OUT/results" --no-html \
    --name "$DAY-1x$CARD-$name$TAG" --variants anchor,engine,engine_transformers_mixer "$@"
  grep -E "x tokens/s|^gpu clocks|status|^anchor|^engine" "$OUT/logs/$name.log" | cut -c1-200
}

launch nemotron-3-nano-30b-a3b-L8-4096x1 --preset nemotron-3-nano-30b-a3b --layers 8 --seq 4096 --batch 1
launch qwen3.5-35b-a3b-L8-4096x1 --preset qwen3.5-35b-a3b --layers 8 --seq 4096 --batch 1
if [ -n "${ONLY:-}" ]; then
  launch qwen3-next-80b-a3b-L8-4096x1 --preset qwen3-next-80b-a3b --layers 8 --seq 4096 --batch 1
fi
finish
