#!/usr/bin/env bash
# Session 10, last call (1 x H200, ~8 minutes; carry .whl and .device_commit): the session's kernels compiled
# (fused MLA q/k/v, the clipping norm's sum of squares, equal CE chunks, DeepSeek's tensor-core router logits) in
# their tests and the bf16 family parity on CUDA, then Qwen3 L8 and Moonlight L8 at seq 4096 x 2 (anchor, engine,
# engine_cuda_graphs), one launch each.
#   OUT=/path bash benchmarks/gpu_session10d.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
gpu_tests 150 tests/test_mla_attention.py tests/test_sum_squares.py tests/test_stack_graphs.py tests/test_router.py \
  "tests/test_generic_families.py::test_bf16_on_cuda_matches_transformers_grouped_mm"
bench_row qwen3-L8-4096x2-s10d 170 --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
bench_row moonlight-L8-s10d $((500 - SECONDS + T0)) --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine,engine_cuda_graphs
