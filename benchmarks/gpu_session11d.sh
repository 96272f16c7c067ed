#!/usr/bin/env bash
# Session 11, fourth call (1 x H200, ~8 minutes; carry .whl and .device_commit): the dense SwiGLU MLPs on the fused
# kernel (models/swiglu_mlp.py) and the host-answered packed check in their CUDA tests, then one launch each:
# Moonlight L8 seq 4096 x 2 (anchor, engine) and, with the time left, gpt-oss-20b L8 (flex anchor, engine, the
# least-memory row) after the CE's new chunk rule.
#   OUT=/path bash benchmarks/gpu_session11d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 110 tests/test_swiglu_mlp.py tests/test_mla_attention.py tests/test_unpacked_rows.py \
  "tests/test_generic_families.py::test_bf16_on_cuda_matches_transformers_grouped_mm"
bench_row moonlight-L8-s11d 150 --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
bench_row gpt-oss-20b-L8-s11d $((560 - SECONDS + T0)) --preset gpt-oss-20b --layers 8 --seq 4096 --batch 2 \
  --variants anchor_flex,engine,engine_in_backward_ac
