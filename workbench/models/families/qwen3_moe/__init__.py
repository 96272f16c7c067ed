"""Qwen3-MoE: the generic path plus the engine's attention, decoder layer and router (its presets, its q/k norms).

- attention.py: RoPE on one fused kernel (rope='triton'), and the q/k/v projections as one node.
- decoder.py: the residual stream's adds folded into the kernels around them (with the engine's attention).
- router.py: float32 router logits; the softmax + top-k kernel by BackendConfig.router.
"""

from __future__ import annotations

from typing import Any

from workbench.models.families.family import AttentionWidths, Family
from workbench.models.families.qwen3_moe.presets import PRESETS


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine modules where the resolved `backend` asks for them; how many of each."""
    # Transformers' Qwen3-MoE modeling module comes with these: imported when a model is built, not with the presets
    from workbench.models.families.qwen3_moe.attention import use_engine_attention
    from workbench.models.families.qwen3_moe.decoder import use_engine_decoder_layers
    from workbench.models.families.qwen3_moe.router import use_engine_router

    return {
        "rope": use_engine_attention(model, backend.rope),
        "fused_residual": use_engine_decoder_layers(model, backend.rope),
        "float32_router": use_engine_router(model, backend.router),
    }


def attention_params(widths: AttentionWidths) -> int:
    """Its per-head q_norm and k_norm."""
    return 2 * widths.head_dim


TEST_CONFIG: dict[str, Any] = dict(intermediate_size=32, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)

FAMILY = Family(
    model_type="qwen3_moe",
    name="Qwen3-MoE",
    presets=PRESETS,
    test_config=TEST_CONFIG,
    install_extras=install_extras,
    attention_params=attention_params,
    qk_norm=True,
)
