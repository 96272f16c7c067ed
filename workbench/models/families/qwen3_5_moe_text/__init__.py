"""Qwen3.5-MoE's text model: the generic path plus the engine's Gated DeltaNet (its presets, its tests' config).

- mixer.py: the chunked gated delta rule, conv and gated norm in plain torch ops, compiled on CUDA
  (BackendConfig.mixer; models/mixer_gated_delta.py), and the decoder layer that hands it packed documents.
"""

from __future__ import annotations

from typing import Any

from workbench.models.families.family import AttentionWidths, Family, LayerBlocks
from workbench.models.families.qwen3_5_moe_text.presets import PRESETS


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine Gated DeltaNets where the resolved `backend` asks for them; how many."""
    # Transformers' Qwen3.5-MoE modeling module comes with it: imported when a model is built, not with the presets
    from workbench.models.families.qwen3_5_moe_text.mixer import use_engine_mixers

    return {"mixer": use_engine_mixers(model, backend.mixer)}


def attention_params(widths: AttentionWidths) -> int:
    """Its per-head q_norm and k_norm."""
    return 2 * widths.head_dim


def layer_blocks(cfg, moe_flags: list[bool]) -> tuple[LayerBlocks, ...]:
    """A Gated DeltaNet ('linear_attention') or attention in each layer, before its MoE (or dense MLP)."""
    mixers = {"linear_attention": "gated_deltanet", "full_attention": "attention"}
    return tuple(LayerBlocks(mixers[t], "moe" if moe else "dense") for t, moe in zip(cfg.layer_types, moe_flags))


TEST_CONFIG: dict[str, Any] = dict(
    moe_intermediate_size=16,
    shared_expert_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=2,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)

FAMILY = Family(
    model_type="qwen3_5_moe_text",
    name="Qwen3.5-MoE",
    presets=PRESETS,
    test_config=TEST_CONFIG,
    install_extras=install_extras,
    attention_params=attention_params,
    layer_blocks=layer_blocks,
    gated_query=True,  # its q_proj also gives the attention output's gate
    shared_expert_gate=True,
)
