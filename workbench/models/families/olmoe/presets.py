"""OLMoE's presets: a tiny twin and OLMoE-1B-7B."""

from __future__ import annotations

from typing import Any

from workbench.models.families.preset import TINY_COMMON, Preset


def _tiny_olmoe() -> dict[str, Any]:
    # OLMoE: full multi-head attention with q/k norms over all heads, no top-k renormalization.
    return dict(
        TINY_COMMON,
        intermediate_size=32,
        num_key_value_heads=4,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        rope_theta=10000.0,
        router_aux_loss_coef=0.01,
    )


def _olmoe_1b_7b() -> dict[str, Any]:
    return dict(
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        clip_qkv=None,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.01,
        bos_token_id=None,
        eos_token_id=50279,
        pad_token_id=1,
    )


PRESETS = (
    Preset("tiny-olmoe", "olmoe", "OLMoE", _tiny_olmoe),
    Preset("olmoe-1b-7b", "olmoe", "OLMoE", _olmoe_1b_7b, "allenai/OLMoE-1B-7B-0924"),
)
