"""Qwen3.5-MoE's presets (its text model): a tiny twin and Qwen3.5-35B-A3B (Gated DeltaNet + attention layers)."""

from __future__ import annotations

from typing import Any

from workbench.models.families.gated_deltanet import tiny_preset
from workbench.models.families.preset import Preset


def _qwen3_5_35b_a3b() -> dict[str, Any]:
    return dict(
        vocab_size=248320,
        hidden_size=2048,
        num_hidden_layers=40,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        max_position_embeddings=262144,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
    )


PRESETS = (
    Preset("tiny-qwen3.5-moe", "qwen3_5_moe_text", "Qwen3.5-MoE", tiny_preset),
    Preset("qwen3.5-35b-a3b", "qwen3_5_moe_text", "Qwen3.5-MoE", _qwen3_5_35b_a3b, "Qwen/Qwen3.5-35B-A3B"),
)
