"""The layout Qwen3-Next, Qwen3.5-MoE and Qwen4-Exp share: Gated DeltaNet ('linear_attention') and gated attention
layers before experts with a gated shared expert (Lara-Mini's attention and shared expert have no gate: its record
says so). Each family keeps its own folder for its own Transformers classes (its engine mixer module) and presets;
what is the same in all is here once."""

from __future__ import annotations

from typing import Any

from workbench.models.families.family import AttentionWidths, LayerBlocks
from workbench.models.families.preset import TINY_COMMON


def attention_params(widths: AttentionWidths) -> int:
    """Its per-head q_norm and k_norm."""
    return 2 * widths.head_dim


def layer_blocks(cfg, moe_flags: list[bool]) -> tuple[LayerBlocks, ...]:
    """A Gated DeltaNet ('linear_attention') or attention (any other layer type: full, sliding-window, Qwen4-Exp's
    indexed) in each layer, before its MoE (or dense MLP)."""
    return tuple(
        LayerBlocks("gated_deltanet" if t == "linear_attention" else "attention", "moe" if moe else "dense")
        for t, moe in zip(cfg.layer_types, moe_flags)
    )


# the tests' tiny config (tests/generic_families.py): one Gated DeltaNet layer, one attention layer
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


def tiny_preset() -> dict[str, Any]:
    """The tiny twin's shape: three Gated DeltaNet layers to one attention layer, as the published models."""
    return dict(
        TINY_COMMON,
        num_hidden_layers=4,
        full_attention_interval=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        router_aux_loss_coef=0.001,
    )


# what a Gated DeltaNet family's Family record shares (its model_type, name, presets and install_extras are its own)
FAMILY_FIELDS: dict[str, Any] = dict(
    attention_params=attention_params,
    layer_blocks=layer_blocks,
    gated_query=True,  # its q_proj also gives the attention output's gate
    shared_expert_gate=True,
    qk_norm=True,  # its attention layers' per-head q_norm and k_norm
)
