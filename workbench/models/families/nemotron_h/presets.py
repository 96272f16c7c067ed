"""Nemotron-H's presets: a tiny twin and Nemotron 3 Nano 30B-A3B (Mamba2 + MoE + attention layers)."""

from __future__ import annotations

from typing import Any

from workbench.models.families.preset import TINY_COMMON, Preset, with_pattern_prefix

# One character per layer: M Mamba2, E MoE, * attention (Transformers' hybrid_override_pattern).
NANO_PATTERN = "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME"
TINY_PATTERN = "MEM*E"


def _tiny_nemotron_h() -> dict[str, Any]:
    return dict(
        TINY_COMMON,
        num_hidden_layers=len(TINY_PATTERN),
        hybrid_override_pattern=TINY_PATTERN,
        num_key_value_heads=2,
        head_dim=16,
        mamba_num_heads=8,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=2,
        conv_kernel=4,
        chunk_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32,
        intermediate_size=64,
        mlp_hidden_act="relu2",
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
    )


def _nemotron_3_nano() -> dict[str, Any]:
    return dict(
        vocab_size=131072,
        hidden_size=2688,
        num_hidden_layers=len(NANO_PATTERN),
        hybrid_override_pattern=NANO_PATTERN,
        num_attention_heads=32,
        num_key_value_heads=2,
        head_dim=128,
        mamba_num_heads=64,
        mamba_head_dim=64,
        ssm_state_size=128,
        n_groups=8,
        conv_kernel=4,
        chunk_size=128,
        n_routed_experts=128,
        num_experts_per_tok=6,
        moe_intermediate_size=1856,
        n_shared_experts=1,
        moe_shared_expert_intermediate_size=3712,
        mlp_hidden_act="relu2",
        routed_scaling_factor=2.5,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        max_position_embeddings=262144,
        layer_norm_epsilon=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


PRESETS = (
    Preset(
        "tiny-nemotron-h",
        "nemotron_h",
        "Nemotron-H",
        _tiny_nemotron_h,
        depth=with_pattern_prefix("hybrid_override_pattern"),
    ),
    Preset(
        "nemotron-3-nano-30b-a3b",
        "nemotron_h",
        "Nemotron-H",
        _nemotron_3_nano,
        "nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16",
        depth=with_pattern_prefix("hybrid_override_pattern"),
    ),
)
