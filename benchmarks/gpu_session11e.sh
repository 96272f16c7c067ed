#!/usr/bin/env bash
# Session 11, last call (1 x H200, ~6 minutes; carry .whl and .device_commit): the combine forward as one program
# per token (kernels/triton_combine.py) alone (combine_kernel.py) and in its CUDA test, the SwiGLU MLP test compiled,
# then one launch each: Moonlight L8 and Qwen3 L8 at seq 4096 x 2 (anchor, engine).
#   OUT=/path bash benchmarks/gpu_session11e.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 40 python3 benchmarks/combine_kernel.py > "$OUT/combine.log" 2>&1
echo "combine_kernel exit $? after $((SECONDS - T0)) s"; cut -c1-200 "$OUT/combine.log"
gpu_tests 80 tests/test_swiglu_mlp.py "tests/test_kernels.py::test_triton_combine_matches_float64_reference"
bench_row moonlight-L8-s11e 125 --preset moonlight-16b-a3b --layers 8 --seq 4096 --batch 2 --variants anchor,engine
bench_row qwen3-L8-4096x2-s11e $((370 - SECONDS + T0)) --preset qwen3-30b-a3b --layers 8 --seq 4096 --batch 2 \
  --variants anchor,engine
