#!/usr/bin/env bash
# Session 18's first call (1 x H200; carry .whl, .device_commit and .ab with the previous commit's workbench/ in .ab/old):
# the fused CE's softmax-gradient kernel over its launch knobs and the in-place scale (benchmarks/ce_rows_kernel.py),
# the CE CUDA tests, and a same-machine A/B of the trainer's step (old/new alternating, twice).
#   OUT=/path bash benchmarks/gpu_session18a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 120 python3 benchmarks/ce_rows_kernel.py --out "$OUT/ce_rows.json" 2>&1 | tail -20
gpu_tests 200 tests/test_kernels.py tests/test_generic_extras.py -k "ce or cross or scale"
ab_rounds 2 --layers 8 --precision auto --no-trace --steps 20
