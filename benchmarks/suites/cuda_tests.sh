#!/usr/bin/env bash
# The tests a CPU machine cannot run in full: every test under tests/ whose name or parameters name CUDA or a GPU, or
# whose skipif reason does (benchmarks/suites/cuda_only.py selects them at collection): the compiled Triton kernels
# against their torch references, the bf16 parity of each family on the GPU path, CUDA graphs, the update stream,
# cuDNN attention, NVML clocks, NCCL on one GPU. PYTEST_ARGS adds arguments (e.g. "-k adamw", "-x"). The log goes
# to $OUT/logs/cuda-tests.log, a JUnit XML to $OUT/cuda-tests.xml. A few minutes.
#   OUT=/tmp/cuda-tests bash benchmarks/suites/cuda_tests.sh
source "$(dirname "$0")/common.sh"
export PYTHONPATH="$ROOT/benchmarks/suites:$PYTHONPATH"
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of arguments
step cuda-tests "$PY" -m pytest -q -rs -p no:cacheprovider \
  -p cuda_only --ignore=tests/lab --junitxml "$OUT/cuda-tests.xml" ${PYTEST_ARGS:-} tests
[ -f "$OUT/logs/cuda-tests.log" ] && tail -3 "$OUT/logs/cuda-tests.log"
finish
