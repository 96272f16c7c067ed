#!/usr/bin/env bash
# Session 20's A/B (written in session 20, which had no GPU either): Qwen3 L8's trainer step at session 19's end
# (b7ab90f's workbench/ in .ab/s19: the router's one-GEMM backward) against this tree (plus the routing weights in
# the SwiGLU rows, the combine a plain sum: moe/row_weights.py), this tree with expert_wgrad='triton', and this tree
# with embedding='triton' and router='triton' (kernels/embedding.py, kernels/triton_router_topk.py), alternating
# twice; each side's peak memory and the GPU's idle time a step (profile_trainer.py --idle).
# Carry .whl, .device_commit and .ab (git archive b7ab90f workbench | tar -x -C .ab/s19).
#   OUT=/path bash benchmarks/gpu_session20b.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_env.sh
TORCH_KERNELS="--embedding torch --router torch" NEW_KERNELS="--embedding triton --router triton"
ab_sides 2 s19=s19,--expert-wgrad\ autograd rows="new,--expert-wgrad autograd $TORCH_KERNELS" \
  rows_wgrad="new,--expert-wgrad triton $TORCH_KERNELS" rows_kernels="new,--expert-wgrad autograd $NEW_KERNELS" \
  -- --layers 8 --precision auto --no-trace --idle --steps 20
grep -hoE '"gpu_idle_cuda_only": \{"wall_ms": [0-9.]+, "busy_ms": [0-9.]+, "idle_ms": [0-9.]+, "kernels_per_step": [0-9.]+' \
  "$OUT"/ab-*.log
find "$OUT" -mindepth 1 -maxdepth 1 -type d -name 'ab-*' -exec rm -rf {} +
