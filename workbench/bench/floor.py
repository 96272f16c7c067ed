"""The two numbers of a training step: its FLOP floor and the bytes of weights and optimizer state."""

from __future__ import annotations

from typing import Any

from workbench.train.metrics import GIB, flops_per_token

# Measured on the project's H200 (shared/facts.md): bf16 dense matmul and grouped expert GEMM.
H200_MATMUL_TFLOPS = 794.0
H200_GROUPED_MM_TFLOPS = 536.0
H200_COPY_TBPS = 4.25


def param_counts(cfg: Any) -> dict[str, int]:
    """Parameters of a Qwen3-MoE-style config: total, experts, dense, active per token."""
    hidden, layers = cfg.hidden_size, cfg.num_hidden_layers
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    attn = hidden * head_dim * (heads + 2 * kv) + heads * head_dim * hidden + 2 * head_dim  # + q/k norms
    expert = 3 * hidden * cfg.moe_intermediate_size
    experts = layers * cfg.num_experts * expert
    router = layers * cfg.num_experts * hidden
    norms = layers * 2 * hidden + hidden
    embed = cfg.vocab_size * hidden * (1 if cfg.tie_word_embeddings else 2)
    dense = layers * attn + router + norms + embed
    active = layers * (attn + cfg.num_experts_per_tok * expert) + router + norms + embed
    return {"total": experts + dense, "experts": experts, "dense": dense, "active_per_token": active}


def step_floor(cfg: Any, seq: int, batch: int, world: int, matmul_tflops: float = H200_MATMUL_TFLOPS,
               expert_tflops: float = H200_GROUPED_MM_TFLOPS) -> dict[str, float]:
    """Per-GPU FLOP floor of one step and the resident bytes for bf16 weights + AdamW states."""
    tokens = batch * seq
    per_token = flops_per_token(cfg, seq)
    expert_per_token = 6 * cfg.num_hidden_layers * cfg.hidden_size * 3 * cfg.moe_intermediate_size * cfg.num_experts_per_tok
    flops = tokens * per_token
    expert_flops = tokens * expert_per_token
    counts = param_counts(cfg)
    per_rank = counts["total"] / world
    return {
        "flops_per_token": per_token, "flops_per_step_per_gpu": flops,
        "floor_step_s_at_matmul_peak": flops / (matmul_tflops * 1e12),
        "floor_step_s_experts_at_grouped_mm": expert_flops / (expert_tflops * 1e12)
        + (flops - expert_flops) / (matmul_tflops * 1e12),
        "tokens_per_s_per_gpu_ceiling": tokens / (flops / (matmul_tflops * 1e12)),
        "params_total": counts["total"], "params_experts": counts["experts"], "params_dense": counts["dense"],
        # bf16 params + bf16 grads + AdamW exp_avg and exp_avg_sq in the param dtype (torch's fused AdamW)
        "state_gib_per_gpu_bf16_adamw": per_rank * (2 + 2 + 2 + 2) / GIB,
    }
