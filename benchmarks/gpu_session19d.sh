#!/usr/bin/env bash
# Session 19's fourth device call, if device time is left (written in session 19, not run there): where Qwen3 L8's step
# goes with expert_wgrad WGRAD (default triton): profile_trainer.py's profiled step (kernels, aten calls, gaps) and the
# GPU's idle time from a CUDA-only trace. Carry .whl and .device_commit.
#   OUT=/path WGRAD=triton bash benchmarks/gpu_session19d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 200 python3 benchmarks/profile_trainer.py --layers 8 --precision auto --expert-wgrad "${WGRAD:-triton}" --idle \
  --out "$OUT/prof" > "$OUT/prof.log" 2>&1
echo "profile exit $? after $((SECONDS - T0)) s"; grep -E "^auto" "$OUT/prof.log" | cut -c1-700
rm -f "$OUT/prof"/trace-*.json.gz
