"""DeepSeek-V3's multi-head latent attention (Moonlight too) with the engine's fused q/k/v assembly (training path).

The engine changes only how the projections' outputs become query, key and value: one Triton kernel per
direction applies RoPE to q's and the shared key's rotary parts and lays out the three tensors
(kernels/triton_mla.py), where Transformers splits, rotates, concatenates and copies. The projections, the
latent norm, the attention function (sdpa with cuDNN first, eager) and o_proj are Transformers' own modules
and functions, so parameters and state dict keys do not change. With a KV cache (generation), RoPE angles
the kernel does not take, or rope other than 'triton', Transformers' own forward runs.
"""

from __future__ import annotations

import warnings

import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from workbench.models.class_swap import swap_classes
from workbench.models.engine_attention import (
    EngineAttention,
    attention_function,
    engine_forward_applies,
    unit_stride_angles,
    wants_engine_attention,
)

# Shape suffixes: B batch, S sequence, H heads, Q query/key head dim, K kv_b head dim (nope + v), R rotary dim.


class DeepseekV3EngineAttention(EngineAttention, hf.DeepseekV3Attention):
    """Transformers' DeepseekV3Attention whose training forward builds q/k/v with one fused kernel."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, *args, **kwargs):
        """Transformers' forward; without a cache and with rope='triton', q/k/v come from the fused kernel."""
        if not engine_forward_applies(self, args, kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        from workbench.kernels.triton_mla import angles_supported, mla_qkv

        B, S = hidden_states.shape[:-1]
        cos, sin = unit_stride_angles(*position_embeddings)
        if not angles_supported(cos, B, S, self.qk_rope_head_dim):  # before any projection runs
            # said, not silent (as engine_attention.fused_rope_forward's fallback)
            warnings.warn(
                f"rope='triton': the fused MLA kernel does not take cos {tuple(cos.shape)} (strides {cos.stride()}) "
                f"for {B} x {S} tokens; {type(self).__name__} runs Transformers' forward instead",
                stacklevel=2,
            )
            return super().forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q_BSHQ = q.view(B, S, self.num_heads, self.qk_head_dim)
        kv_nope, k_rot_BSR = torch.split(
            self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_BSHK = self.kv_b_proj(self.kv_a_layernorm(kv_nope)).view(
            B, S, self.num_heads, self.qk_nope_head_dim + self.v_head_dim
        )
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        query, key, value = mla_qkv(
            q_BSHQ, kv_BSHK, k_rot_BSR, cos, sin, self.qk_nope_head_dim, bool(self.config.rope_interleave)
        )
        out, weights = attention_function(hf, self.config._attn_implementation)(
            self,
            query.transpose(1, 2),
            key.transpose(1, 2),
            value.transpose(1, 2),
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        return self.o_proj(out.reshape(B, S, -1).contiguous()), weights


def use_mla_attention(model: torch.nn.Module, rope: str) -> int:
    """rope='triton': every DeepseekV3Attention of `model` gets the fused q/k/v forward (same module, parameters)."""
    if not wants_engine_attention(rope):  # 'torch': Transformers' own forward
        return 0
    return swap_classes(model, hf.DeepseekV3Attention, DeepseekV3EngineAttention, rope=rope)
