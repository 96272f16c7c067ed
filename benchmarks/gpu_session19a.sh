#!/usr/bin/env bash
# Session 19's first call (1 x H200; carry .whl and .device_commit): the CUDA tests of session 18's review commits
# (the fused CE's scaling, the q/k/v node, the residual adds, the norm + RoPE kernels), then where Qwen3 L8's and
# L16's steps go on the current code (profile_trainer.py's profiled step: kernels, ops and idle gaps).
#   OUT=/path bash benchmarks/gpu_session19a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 150 tests/test_kernels.py tests/test_qkv_projection.py tests/test_fused_residual.py tests/test_norm_rope.py \
  tests/test_generic_features.py -k "cuda or ce or cross or scale or engine"
for layers in 8 16; do
  timeout 150 python3 benchmarks/profile_trainer.py --layers $layers --precision auto --out "$OUT/prof$layers" \
    > "$OUT/prof$layers.log" 2>&1
  echo "profile L$layers exit $? after $((SECONDS - T0)) s"; grep -E "^auto" "$OUT/prof$layers.log" | cut -c1-700
  rm -f "$OUT/prof$layers"/trace-*.json.gz
done
