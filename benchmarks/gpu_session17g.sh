#!/usr/bin/env bash
# Session 17's last call (1 x H200; carry .whl and .device_commit): the one-division AdamW test on CUDA with its
# bound set from the H200's values (17f measured 4 float32 steps where the CPU's values gave 2).
#   OUT=/path bash benchmarks/gpu_session17g.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 120 tests/test_precision.py -k "one_division or bit_for_bit"
