#!/usr/bin/env bash
# Session 19's second device call (written in session 19, not run there): a same-machine A/B of Qwen3 L8's trainer
# step, the session's start (ed2e47f's workbench/ in .ab/old) against this tree with expert_wgrad 'autograd' (the
# router's one-GEMM backward alone), 'triton' (plus the weight gradient with its squares) and 'autograd' with the
# decoder stack as CUDA graphs (train.cuda_graphs: session 9 measured +3% for +9.7 GiB), alternating twice; each side
# with the GPU's idle time a step from a CUDA-only trace (profile_trainer.py --idle).
# Carry .whl, .device_commit and .ab (git archive ed2e47f workbench | tar -x -C .ab/old).
#   OUT=/path bash benchmarks/gpu_session19b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
ab_sides 2 old=old new=new,--expert-wgrad\ autograd wgrad=new,--expert-wgrad\ triton \
  graphs=new,--expert-wgrad\ autograd\ --cuda-graphs -- --layers 8 --precision auto --no-trace --idle --steps 20
grep -hoE '"gpu_idle_cuda_only": \{"wall_ms": [0-9.]+, "busy_ms": [0-9.]+, "idle_ms": [0-9.]+, "kernels_per_step": [0-9.]+' \
  "$OUT"/ab-*.log
find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ab-*' -exec rm -rf {} +
