"""GPT-OSS attention with the engine's fused RoPE (training path), Transformers' otherwise.

Transformers rotates GPT-OSS's q and k with chunk / mul / sub / add / cat in bf16: ~9 ms of eager elementwise
kernels in a 214 ms step of the 8-layer gpt-oss-20b architecture on an H200 (64 query heads of 64, profile of
session 15). Here one Triton kernel per tensor and direction does it (kernels/triton_rope.py, with GPT-OSS's
half-width cos/sin). Projections, the attention function (the engine's sink attention, eager, flex) with the sinks,
and o_proj are Transformers' modules and functions, so parameters and state dict keys do not change. With a KV
cache (generation), or on a BackendConfig.rope other than 'triton', Transformers' own forward runs.
"""

from __future__ import annotations

import torch
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from workbench.models.engine_attention import attention_function, engine_forward_applies, wants_engine_attention

# Shape suffixes: B batch, H heads, S sequence, D head dim.


class GptOssEngineAttention(hf.GptOssAttention):
    """Transformers' GptOssAttention whose training forward applies RoPE with one fused kernel."""

    workbench_rope = "torch"  # the resolved BackendConfig.rope, set by use_gpt_oss_attention

    def forward(self, hidden_states, position_embeddings, attention_mask=None, *args, **kwargs):
        """Transformers' forward; without a cache and with rope='triton', RoPE is the fused kernel."""
        if not engine_forward_applies(self, args, kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        from workbench.kernels.triton_rope import apply_rope, supported

        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q_BHSD = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k_BHSD = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
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
            s_aux=self.sinks,
            **kwargs,
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights


def use_gpt_oss_attention(model: torch.nn.Module, rope: str) -> int:
    """rope='triton': every GptOssAttention of `model` gets the fused-RoPE forward (same module, parameters)."""
    if not wants_engine_attention(rope):  # 'torch': Transformers' own forward
        return 0
    from workbench.models.class_swap import swap_classes

    # a class swap, not a wrapper: parameter names and state dict keys stay Transformers'
    return swap_classes(model, hf.GptOssAttention, GptOssEngineAttention, workbench_rope=rope)
