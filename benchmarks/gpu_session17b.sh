#!/usr/bin/env bash
# Session 17's second call (1 x H200; carry .whl and .device_commit): can the AdamW update run beside the forward
# (benchmarks/overlap_carveout.py: SM carveout for the GEMMs, the update on a low-priority stream)?
#   OUT=/path bash benchmarks/gpu_session17b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 240 python3 benchmarks/overlap_carveout.py --carveouts 0,8,16,24,32,48 --out "$OUT/overlap.json" \
  > "$OUT/overlap.log" 2>&1
echo "overlap exit $? after $((SECONDS - T0)) s"; grep -E "^\{" "$OUT/overlap.log"; grep -E "Error|Traceback" -A3 "$OUT/overlap.log" | head -20
