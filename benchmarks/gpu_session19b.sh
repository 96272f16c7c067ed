#!/usr/bin/env bash
# Session 19's second device call (written in session 19, not run there): a same-machine A/B of Qwen3 L8's trainer
# step, the session's start (ed2e47f's workbench/ in .ab/old) against this tree with expert_wgrad 'autograd' (the
# router's one-GEMM backward alone) and 'triton' (plus the weight gradient with its squares), alternating twice.
# Carry .whl, .device_commit and .ab (git archive ed2e47f workbench | tar -x -C .ab/old).
#   OUT=/path bash benchmarks/gpu_session19b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
ab_sides 2 old=old new=new,--expert-wgrad\ autograd wgrad=new,--expert-wgrad\ triton -- \
  --layers 8 --precision auto --no-trace --steps 20
find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ab-*' -exec rm -rf {} +
