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

from workbench.models.engine_attention import attention_function, engine_forward_applies, wants_engine_attention

# Shape suffixes: B batch, H heads, S sequence, D head dim.


class Qwen3MoeEngineAttention(hf.Qwen3MoeAttention):
    """Transformers' Qwen3MoeAttention whose training forward applies RoPE with one fused kernel."""

    workbench_rope = "torch"  # the resolved BackendConfig.rope, set by use_engine_attention

    def forward(self, hidden_states, position_embeddings, attention_mask=None, *args, **kwargs):
        """Transformers' forward; without a cache and with rope='triton', RoPE is the fused kernel."""
        if not engine_forward_applies(self, args, kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        from workbench.kernels.triton_rope import apply_rope, supported

        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q_BHSD = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k_BHSD = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v_BHSD = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        if supported(q_BHSD, cos) and supported(k_BHSD, cos):
            q_BHSD, k_BHSD = apply_rope(q_BHSD, k_BHSD, cos, sin)
        else:
            q_BHSD, k_BHSD = hf.apply_rotary_pos_emb(q_BHSD, k_BHSD, cos, sin)
        out, weights = attention_function(hf, self.config._attn_implementation)(
            self,
            q_BHSD,
            k_BHSD,
            v_BHSD,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=getattr(self, "sliding_window", None),
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


def use_engine_attention(model: torch.nn.Module, rope: str) -> int:
    """rope='triton': every Qwen3MoeAttention of `model` gets the fused-RoPE forward (same module, parameters)."""
    if not wants_engine_attention(rope):  # 'torch': Transformers' own forward
        return 0
    from workbench.models.class_swap import swap_classes

    # a class swap, not a wrapper: parameter names and state dict keys stay Transformers'
    return swap_classes(model, hf.Qwen3MoeAttention, Qwen3MoeEngineAttention, workbench_rope=rope)
