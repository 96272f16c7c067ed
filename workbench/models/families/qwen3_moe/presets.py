"""Qwen3-MoE's presets: the tiny model (the default everywhere) and Qwen3-30B-A3B, the benchmark model."""

from __future__ import annotations

from typing import Any

from workbench.models.families.preset import TINY_COMMON, Preset


def _tiny() -> dict[str, Any]:
    return dict(
        TINY_COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        rope_theta=10000.0,
        router_aux_loss_coef=0.01,
    )


def _qwen3_30b_a3b() -> dict[str, Any]:
    # The benchmark model (benchmarks/NOTES.md).
    return dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
        bos_token_id=151643,
        eos_token_id=151645,
    )


PRESETS = (
    Preset("tiny", "qwen3_moe", "Qwen3-MoE", _tiny),
    Preset("qwen3-30b-a3b", "qwen3_moe", "Qwen3-MoE", _qwen3_30b_a3b, "Qwen/Qwen3-30B-A3B"),
)
