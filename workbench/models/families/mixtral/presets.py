"""Mixtral's presets: a tiny twin and Mixtral-8x7B."""

from __future__ import annotations

from typing import Any

from workbench.models.families.preset import TINY_COMMON, Preset


def _tiny_mixtral() -> dict[str, Any]:
    # Mixtral's expert width is intermediate_size (it has no dense layers).
    return dict(
        TINY_COMMON,
        intermediate_size=64,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        rope_theta=10000.0,
        sliding_window=None,
        router_aux_loss_coef=0.02,
    )


def _mixtral_8x7b() -> dict[str, Any]:
    return dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-5,
        sliding_window=None,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.02,
        bos_token_id=1,
        eos_token_id=2,
    )


PRESETS = (
    Preset("tiny-mixtral", "mixtral", "Mixtral", _tiny_mixtral),
    Preset("mixtral-8x7b", "mixtral", "Mixtral", _mixtral_8x7b, "mistralai/Mixtral-8x7B-v0.1"),
)
