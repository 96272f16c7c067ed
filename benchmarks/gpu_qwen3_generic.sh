#!/usr/bin/env bash
# Qwen3-30B-A3B (random init) truncated to 8 layers on 1 x H200: the Transformers v5 anchor, the
# engine and the engine with the balanced gate in one launch (seq 4096 x local batch 2, bf16,
# fused cross-entropy). The issue-14 bar: the engine row >= 1.74x the anchor's tokens/s.
# Usage (repository root, on the device; ~3 minutes):  bash benchmarks/gpu_qwen3_generic.sh OUT.json
set -euo pipefail
out="${1:?usage: gpu_qwen3_generic.sh OUT.json}"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export WORKBENCH_BENCH_TMP="${WORKBENCH_BENCH_TMP:-/tmp}"   # the shared initial checkpoint, deleted after
dir="$(mktemp -d)"
"${PYTHON:-python3}" -m workbench.cli bench --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --warmup 2 --steps 8 --variants anchor,engine,engine_balanced --fused-ce --no-html \
  --out-dir "$dir" --name qwen3-generic
cp "$dir/qwen3-generic.json" "$out"
"${PYTHON:-python3}" - "$out" <<'PY'
import json, sys
for c in json.load(open(sys.argv[1]))["comparisons"]:
    anchor = c["anchor"]["tokens_per_s_per_gpu"]
    for key in ("anchor", "engine"):
        row = c[key]
        print(f"gate={c['gate']:8s} {row['variant']:16s} {row['tokens_per_s_per_gpu']:9,.0f} tokens/s/GPU "
              f"{row['tokens_per_s_per_gpu'] / anchor:5.2f}x  peak {row['peak_mem_gib']:.1f} GiB")
PY
