"""Qwen3-MoE attention with the engine's fused RoPE (training path), Transformers' otherwise.

The engine changes only how RoPE is applied: one Triton kernel per direction for q and k instead
of Transformers' cat/neg/mul/add chain (kernels/triton_rope.py). Projections, per-head q/k norms,
the attention function (sdpa with cuDNN first, TE, eager) and o_proj are Transformers' modules and
functions, so parameters and state dict keys do not change. With a KV cache (generation), or on a
BackendConfig.rope other than 'triton', Transformers' own forward runs.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from workbench.models.class_swap import swap_classes
from workbench.models.engine_attention import (
    EngineAttention,
    engine_forward_applies,
    fused_rope_forward,
    wants_engine_attention,
)


class Qwen3MoeEngineAttention(EngineAttention, hf.Qwen3MoeAttention):
    """Transformers' Qwen3MoeAttention whose training forward applies RoPE with one fused kernel."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, *args, residual=None, **kwargs):
        """Transformers' forward; without a cache and with rope='triton', RoPE is the fused kernel.

        `residual` (the engine's decoder layer): the output comes back with it added (in o_proj's GEMM).
        """
        if not engine_forward_applies(self, args, kwargs):
            out, weights = super().forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
            return (out if residual is None else residual + out), weights
        return fused_rope_forward(
            self,
            hf,
            hidden_states,
            position_embeddings,
            attention_mask,
            kwargs,
            q_norm=self.q_norm,
            k_norm=self.k_norm,
            residual=residual,
        )


def use_engine_attention(model: torch.nn.Module, rope: str) -> int:
    """rope='triton': every Qwen3MoeAttention of `model` gets the fused-RoPE forward (same module, parameters)."""
    if not wants_engine_attention(rope):  # 'torch': Transformers' own forward
        return 0
    # a class swap, not a wrapper: parameter names and state dict keys stay Transformers'
    return swap_classes(model, hf.Qwen3MoeAttention, Qwen3MoeEngineAttention, rope=rope)
