#!/usr/bin/env bash
# Session 11, first call (1 x H200, ~5 minutes; carry .whl and .device_commit): the A/B of Transformers' per-forward
# packed-rows check (gpu_session10e.sh: eager engine steps with and without the check's host read, Moonlight L8 and
# Qwen3 L8 at seq 4096 x 2, alternating), then session 10's post-a67ea9a refactors (the MLA kernels' layout helper,
# class_swap, engine_attention) in their CUDA tests.
#   OUT=/path bash benchmarks/gpu_session11a.sh
set -uo pipefail
cd "$(dirname "$0")/.."
bash benchmarks/gpu_session10e.sh
source benchmarks/gpu_env.sh
gpu_tests 200 tests/test_mla_attention.py tests/test_stack_graphs.py tests/test_router.py \
  "tests/test_generic_families.py::test_bf16_on_cuda_matches_transformers_grouped_mm"
