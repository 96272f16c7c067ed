#!/usr/bin/env bash
# Session 21's third device call: the CUDA tests of the corrected pair-GEMM bounds (and, when it ran, of the Triton
# row gather, since reverted), then two A/B rounds of the trainer's step: 18984cc (session 20's end, in .ab/s20)
# against this tree. Carry .whl, .device_commit and .ab.
#   OUT=/path bash benchmarks/gpu_session21c.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 100 tests/test_mm_fp32.py tests/test_row_weights.py tests/test_fused_residual.py tests/test_qkv_projection.py
grep -E "FAILED|^E " "$OUT/pytest.log" | head -8 | cut -c1-300
# (here ran benchmarks/gather_rows_bench.py: removed with the gather kernel after this call, NOTES session 21)
ab_sides 2 s20=s20 new=new -- --layers 8 --precision auto --no-trace --steps 20
find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ab-*' -exec rm -rf {} +
