"""The two numbers of a training step: its FLOP floor and the bytes of weights and optimizer state."""

from __future__ import annotations

from typing import Any

from workbench.params import param_counts
from workbench.train.metrics import GIB, flops_per_token

# Measured on the project's H200 (benchmarks/NOTES.md): bf16 dense matmul and grouped expert GEMM.
H200_MATMUL_TFLOPS = 794.0
H200_GROUPED_MM_TFLOPS = 536.0


def step_floor(
    cfg: Any,
    seq: int,
    batch: int,
    world: int,
    matmul_tflops: float = H200_MATMUL_TFLOPS,
    expert_tflops: float = H200_GROUPED_MM_TFLOPS,
) -> dict[str, float]:
    """Per-GPU FLOP floor of one step and the resident bytes for bf16 weights + AdamW states."""
    tokens = batch * seq
    per_token = flops_per_token(cfg, seq)
    counts = param_counts(cfg)
    expert_per_token = 6 * counts.moe_layers * counts.top_k * counts.expert_matmul  # the grouped GEMMs' share
    flops = tokens * per_token
    expert_flops = tokens * expert_per_token
    per_rank = counts.total / world
    return {
        "flops_per_token": per_token,
        "flops_per_step_per_gpu": flops,
        "floor_step_s_at_matmul_peak": flops / (matmul_tflops * 1e12),
        "floor_step_s_experts_at_grouped_mm": expert_flops / (expert_tflops * 1e12)
        + (flops - expert_flops) / (matmul_tflops * 1e12),
        "tokens_per_s_per_gpu_ceiling": tokens / (flops / (matmul_tflops * 1e12)),
        "params_total": counts.total,
        "params_experts": counts.experts,
        "params_dense": counts.dense,
        # bf16 params + bf16 grads + AdamW exp_avg and exp_avg_sq in the param dtype (torch's fused AdamW)
        "state_gib_per_gpu_bf16_adamw": per_rank * (2 + 2 + 2 + 2) / GIB,
    }
