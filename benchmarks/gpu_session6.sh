#!/usr/bin/env bash
# Session 6 device run on 1 x H200 (issue 15): the compiled AdamW kernels' tests, the AdamW modes over the L8
# model's tensors (benchmarks/adamw_modes.py), then `workbench bench` launch A of gpu_session5.sh (qwen3-30b-a3b
# L8, seq 4096 x 2, every fair row, 30 timed steps) once the tests pass. Everything lands under $OUT.
#   OUT=/path bash benchmarks/gpu_session6.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
timeout 200 python3 -m pytest -q -rs tests/test_trainer_async.py tests/test_optim_triton.py -k "cuda or compiled" \
  2>&1 | tee "$OUT/pytest.log" | tail -5
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "kernel tests failed: no bench"; exit 1; }
(cd benchmarks && timeout 120 python3 adamw_modes.py --out "$OUT/adamw-modes.json" 2>&1 | grep -v "^model_type")
BUDGET_S="${BUDGET_S:-400}" OUT="$OUT/bench" bash benchmarks/gpu_session5.sh 2>&1 | grep -v "^model_type" | tail -60
