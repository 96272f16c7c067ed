#!/usr/bin/env bash
# The tests a CPU machine cannot run in full: every test under tests/ whose name or parameters name CUDA or a GPU, or
# whose skipif reason does (benchmarks/suites/cuda_only.py selects them at collection): the compiled Triton kernels
# against their torch references, the bf16 parity of each family on the GPU path, CUDA graphs, the update stream,
# cuDNN attention, NVML clocks, NCCL on one GPU. Arguments go to pytest (e.g. -x, or -k "adamw or combine"). The
# log goes to $OUT/logs/cuda-tests.log, a JUnit XML to $OUT/cuda-tests.xml. A few minutes.
#   OUT=/tmp/cuda-tests bash benchmarks/suites/cuda_tests.sh [PYTEST ARGS...]
source "$(dirname "$0")/common.sh"
export PYTHONPATH="$ROOT/benchmarks/suites:$PYTHONPATH"
# A test module that fails to import is reported (and fails the suite) without stopping the others.
step cuda-tests "$PY" -m pytest -q -rs -p no:cacheprovider -p cuda_only --ignore=tests/lab \
  --continue-on-collection-errors --junitxml "$OUT/cuda-tests.xml" "$@" tests
[ -f "$OUT/logs/cuda-tests.log" ] && tail -3 "$OUT/logs/cuda-tests.log"
finish
