"""Qwen3-Next's presets: a tiny twin and Qwen3-Next-80B-A3B (Gated DeltaNet + attention layers)."""

from __future__ import annotations

from typing import Any

from workbench.models.families.gated_deltanet import tiny_preset
from workbench.models.families.preset import Preset


def _tiny_qwen3_next() -> dict[str, Any]:
    return dict(tiny_preset(), intermediate_size=64)


def _qwen3_next_80b_a3b() -> dict[str, Any]:
    return dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=5120,
        num_hidden_layers=48,
        full_attention_interval=4,
        num_attention_heads=16,
        num_key_value_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        num_experts=512,
        num_experts_per_tok=10,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=262144,
        rope_theta=10_000_000.0,
        partial_rotary_factor=0.25,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        router_aux_loss_coef=0.001,
        bos_token_id=151643,
        eos_token_id=151645,
    )


PRESETS = (
    Preset("tiny-qwen3-next", "qwen3_next", "Qwen3-Next", _tiny_qwen3_next),
    Preset("qwen3-next-80b-a3b", "qwen3_next", "Qwen3-Next", _qwen3_next_80b_a3b, "Qwen/Qwen3-Next-80B-A3B-Instruct"),
)
