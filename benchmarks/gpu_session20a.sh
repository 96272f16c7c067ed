#!/usr/bin/env bash
# Session 20's first device call (written in session 20 with no GPU lent; session 19's 19a plus session 20's kernels):
# the CUDA tests of the router's one-GEMM backward, the Triton expert weight gradient, the weighted SwiGLU and
# plain-sum combine (tests/test_row_weights.py), the embedding gradient (tests/test_embedding_grad.py) and the
# router's softmax + top-k (tests/test_router_topk.py), then the weight gradient kernel against CUTLASS plus the
# norm's read, per launch choice (benchmarks/grouped_wgrad.py: ~20 Triton compiles). Carry .whl and .device_commit.
#   OUT=/path bash benchmarks/gpu_session20a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 240 tests/test_row_weights.py tests/test_embedding_grad.py tests/test_router_topk.py \
  tests/test_grouped_wgrad.py tests/test_mm_fp32.py tests/test_fused_residual.py tests/test_kernels.py tests/test_parity.py \
  tests/test_generic_features.py \
  -k "cuda or wgrad or pair or passing or engine_match or cross or scale or row or weights or bfloat16 or embedding"
timeout $((580 - SECONDS + T0)) python3 benchmarks/grouped_wgrad.py --out "$OUT/grouped_wgrad.json" \
  > "$OUT/grouped_wgrad.log" 2>&1
echo "grouped_wgrad exit $? after $((SECONDS - T0)) s"; grep -E "^dw_" "$OUT/grouped_wgrad.log" | cut -c1-3000
grep -iE "error|Traceback" "$OUT/grouped_wgrad.log" | head -5
