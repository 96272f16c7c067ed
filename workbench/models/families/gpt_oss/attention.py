"""GPT-OSS attention with the engine's fused RoPE (training path), Transformers' otherwise.

Transformers rotates GPT-OSS's q and k with chunk / mul / sub / add / cat in bf16: ~9 ms of eager elementwise
kernels in a 214 ms step of the 8-layer gpt-oss-20b architecture on an H200 (64 query heads of 64, profile of
2026-12-04). Here one Triton kernel per tensor and direction does it (kernels/triton_rope.py, with GPT-OSS's
half-width cos/sin). Projections, the attention function (the engine's sink attention, eager, flex) with the sinks,
and o_proj are Transformers' modules and functions, so parameters and state dict keys do not change. With a KV
cache (generation), or on a BackendConfig.rope other than 'triton', Transformers' own forward runs.
"""

from __future__ import annotations

import torch
from transformers.models.gpt_oss import modeling_gpt_oss as hf

from workbench.models.class_swap import swap_classes
from workbench.models.engine_attention import (
    EngineAttention,
    engine_forward_applies,
    fused_rope_forward,
    wants_engine_attention,
)


class GptOssEngineAttention(EngineAttention, hf.GptOssAttention):
    """Transformers' GptOssAttention whose training forward applies RoPE with one fused kernel."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, *args, **kwargs):
        """Transformers' forward; without a cache and with rope='triton', RoPE is the fused kernel."""
        if not engine_forward_applies(self, args, kwargs):
            return super().forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        return fused_rope_forward(
            self, hf, hidden_states, position_embeddings, attention_mask, kwargs, s_aux=self.sinks
        )


def use_gpt_oss_attention(model: torch.nn.Module, rope: str) -> int:
    """rope='triton': every GptOssAttention of `model` gets the fused-RoPE forward (same module, parameters)."""
    if not wants_engine_attention(rope):  # 'torch': Transformers' own forward
        return 0
    # a class swap, not a wrapper: parameter names and state dict keys stay Transformers'
    return swap_classes(model, hf.GptOssAttention, GptOssEngineAttention, rope=rope)
