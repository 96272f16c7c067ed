"""DeepSeek-V3's presets: a tiny twin with every part of its structure, and Moonlight-16B-A3B."""

from __future__ import annotations

from typing import Any

from workbench.models.families.preset import TINY_COMMON, Preset


def _tiny_deepseek_v3() -> dict[str, Any]:
    # DeepSeek-V3's structure: MLA with a low-rank q (q_lora_rank) and kv, one dense first layer, shared
    # experts, and group-limited routing that actually limits (2 groups, tokens pick from 1).
    return dict(
        TINY_COMMON,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        rope_theta=10000.0,
        num_nextn_predict_layers=0,
    )


def _moonlight_16b_a3b() -> dict[str, Any]:
    # Published with n_group = topk_group = 1 (one group: routing is not limited in practice).
    return dict(
        vocab_size=163840,
        hidden_size=2048,
        intermediate_size=11264,
        moe_intermediate_size=1408,
        num_hidden_layers=27,
        num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=64,
        n_shared_experts=2,
        num_experts_per_tok=6,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=None,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        routed_scaling_factor=2.446,
        norm_topk_prob=True,
        max_position_embeddings=8192,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        attention_bias=False,
        tie_word_embeddings=False,
        num_nextn_predict_layers=0,
        bos_token_id=163584,
        eos_token_id=163586,
    )


PRESETS = (
    Preset("tiny-deepseek-v3", "deepseek_v3", "DeepSeek-V3", _tiny_deepseek_v3),
    Preset("moonlight-16b-a3b", "deepseek_v3", "DeepSeek-V3", _moonlight_16b_a3b, "moonshotai/Moonlight-16B-A3B"),
)
