#!/usr/bin/env bash
# Session 17's first call (1 x H200; carry .whl and .device_commit): ATen's grouped GEMMs against Inductor's
# autotuned Triton template at Qwen3-30B-A3B's six per-layer shapes, a profile of the trainer's Qwen3 L8 step, and
# the sink kernels' CUDA tests (session 16's last change compiled on the GPU).
#   OUT=/path bash benchmarks/gpu_session17a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 300 python3 benchmarks/grouped_mm_tune.py --out "$OUT/grouped_mm.json" > "$OUT/grouped_mm.log" 2>&1
echo "grouped_mm exit $? after $((SECONDS - T0)) s"; grep -E "^(fwd|dx|dw)_" "$OUT/grouped_mm.log" | cut -c1-400
grep -iE "error|Traceback" "$OUT/grouped_mm.log" | head -5
timeout 150 python3 benchmarks/profile_trainer.py --layers 8 --precision auto --out "$OUT/prof" > "$OUT/prof.log" 2>&1
echo "profile exit $? after $((SECONDS - T0)) s"; grep -E "^auto|wall" "$OUT/prof.log" | cut -c1-600
gpu_tests 90 tests/test_attention_sinks.py -k cuda
