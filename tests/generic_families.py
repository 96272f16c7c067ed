"""Tiny configs of Transformers v5 MoE families, built from each family's own config class (no hub)."""

from __future__ import annotations

import transformers

from workbench.models.families import REGISTERED

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    initializer_range=0.02,
)

# Families without a folder of their own (workbench.models.generic.TESTED_WITHOUT_FOLDER); each registered family's
# folder holds its own (Family.test_config, workbench/models/families/<model_type>/).
WITHOUT_FOLDER = {
    "qwen2_moe": dict(
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=24,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
    ),
    "glm4_moe": dict(
        intermediate_size=32,
        moe_intermediate_size=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        partial_rotary_factor=0.5,
    ),
    "minimax_m2": dict(intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
    "ernie4_5_moe": dict(
        intermediate_size=32,
        moe_intermediate_size=16,
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_layer_start_index=1,
        moe_layer_interval=1,
        use_bias=True,
    ),
    "hunyuan_v1_moe": dict(intermediate_size=16, num_experts=4, moe_topk=2, num_shared_expert=1, use_qk_norm=True),
}

# Every family the tests compare with vanilla Transformers: the registered ones, then those without a folder.
FAMILIES = {**{f.model_type: dict(f.test_config) for f in REGISTERED}, **WITHOUT_FOLDER}


def tiny_config(family: str, **overrides):
    """A tiny float32 config of `family` from its own Transformers config class (`overrides` for one not listed)."""
    fields = {**COMMON, **FAMILIES.get(family, {}), **overrides}
    return transformers.AutoConfig.for_model(family, **fields)
