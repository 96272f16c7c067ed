"""Tiny configs of Transformers v5 MoE families, built from each family's own config class (no hub)."""

from __future__ import annotations

import functools

import pytest
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


# ---------------------------------------------------------------- the census: every family with v5 fused experts

# Config fields of Transformers' MoE families and their tiny values, set where the family's config has the field.
EXPERT_COUNT_FIELDS = ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "num_experts_per_token")
TINY_FIELDS = {
    "n_group": 2,
    "num_expert_group": 2,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 8,
    "index_head_dim": 8,
    "index_n_heads": 2,
    "index_num_heads": 2,
    "index_topk": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_num_heads": 4,
    "mamba_head_dim": 8,
    "mamba_d_head": 8,
    "mamba_num_heads": 4,
    "mamba_n_heads": 4,
    "n_groups": 2,
    "mamba_n_groups": 2,
    "ssm_state_size": 8,
    "mamba_d_state": 8,
    "swa_head_dim": 8,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "hidden_size_per_layer_input": 8,
    "vocab_size_per_layer_input": 96,
    "router_hidden_size": 8,
    "unpadded_vocab_size": 96,
    "sliding_window": 8,
    "num_layers": 2,
    "first_k_dense_replace": 1,
    "num_dense_layers": 1,
    "num_dense_blocks": 1,
    "moe_layer_start_index": 1,
}
# The per-layer pattern fields: the tiny model keeps one layer of each kind, in the family's order.
LAYER_PATTERN_FIELDS = ("layer_types", "mlp_layer_types", "layers_block_type")

# What the rules above cannot know: a family's own constraints (its config class refuses the rest).
CENSUS_OVERRIDES = {
    "dots3_note_text": dict(
        num_key_value_heads=4,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=4,
        swa_q_lora_rank=16,
        swa_kv_lora_rank=16,
        swa_head_dim=16,
        swa_qk_nope_head_dim=8,
        swa_v_head_dim=8,
    ),
    "flint": dict(mlp_only_layers=[0]),
    "gemma4_text": dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16),
    "granitemoehybrid": dict(mamba_n_heads=8, layer_types=["linear_attention", "full_attention"]),
    "jamba": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=0, use_mamba_kernels=False
    ),
    "kolibri1_1": dict(head_dim=16, kv_source_layers=[0, 1], index_layers=[1], mlp_only_layers=[0]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "qwen4_exp_text": dict(
        indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=8, indexer_compress_ratio=4
    ),
    "zaya": dict(num_experts_per_tok=1),  # its config refuses more
}


def _is_decorated_experts(cls) -> bool:
    # the decorator's forward: one code object for every class it decorated (transformers.integrations.moe)
    return getattr(vars(cls).get("forward"), "__code__", None) is _DECORATED_FORWARD


def _decorated_forward_code():
    from torch import nn
    from transformers.integrations import moe

    class Probe(nn.Module):
        def forward(self, x):
            return x

    return moe.use_experts_implementation(Probe).forward.__code__


_DECORATED_FORWARD = _decorated_forward_code()


@functools.cache
def fused_experts_model_types() -> tuple[str, ...]:
    """Every model_type of the installed Transformers whose causal LM's modeling module holds a class decorated with
    @use_experts_implementation (defined there or imported), text models only: a composite config (vision + text)
    is covered by its text model_type."""
    import sys

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    found = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        if model_type not in transformers.CONFIG_MAPPING:
            continue
        config_class = transformers.CONFIG_MAPPING[model_type]
        if config_class.sub_configs:
            continue
        module = sys.modules[MODEL_FOR_CAUSAL_LM_MAPPING[config_class].__module__]
        if any(isinstance(v, type) and _is_decorated_experts(v) for v in vars(module).values()):
            found.append(model_type)
    return tuple(found)


def composite_model_types() -> dict[str, str]:
    """{composite model_type: its text model_type} of the families with v5 fused experts left out above."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        if model_type not in transformers.CONFIG_MAPPING:
            continue
        config_class = transformers.CONFIG_MAPPING[model_type]  # a lazy mapping: no .get
        text = (config_class.sub_configs or {}).get("text_config")
        if getattr(text, "model_type", None) in fused_experts_model_types():  # some name AutoConfig: any text model
            out[model_type] = text.model_type
    return out


def _one_layer_of_each_kind(defaults: dict) -> dict:
    patterns = {k: defaults[k] for k in LAYER_PATTERN_FIELDS if isinstance(defaults.get(k), list) and defaults[k]}
    if not patterns:
        return {}
    length = max(len(v) for v in patterns.values())
    kinds, keep = set(), []
    for i in range(length):
        kind = tuple(v[i] if i < len(v) else None for v in patterns.values())
        if kind not in kinds:
            kinds.add(kind)
            keep.append(i)
    keep = keep if len(keep) >= 2 else list(range(min(2, length)))
    fields = {"num_hidden_layers": len(keep)}
    for key, value in defaults.items():  # every per-layer list of the family, cut to the kept layers
        if isinstance(value, list) and (key in patterns or len(value) == length):
            fields[key] = [value[i] for i in keep if i < len(value)]
    return fields


def census_fields(model_type: str) -> dict:
    """The tiny config fields of `model_type`: its own defaults made small by the rules above, then its overrides."""
    defaults = transformers.CONFIG_MAPPING[model_type]().to_dict()
    fields = dict(COMMON)
    for key, value in defaults.items():
        if isinstance(value, bool):
            continue
        if key in EXPERT_COUNT_FIELDS and (value is not None or key == "n_routed_experts"):
            fields[key] = 4
        elif key in TOP_K_FIELDS and (value is not None or key == "num_experts_per_tok"):
            fields[key] = 2
        elif isinstance(value, int) and key.endswith(("intermediate_size", "ffn_hidden_size")):
            fields[key] = 16 if ("moe" in key or "expert" in key) else 32
        elif isinstance(value, int) and key in TINY_FIELDS:
            fields[key] = min(value, TINY_FIELDS[key])
    if defaults.get("n_shared_experts", 0) is None:
        fields["n_shared_experts"] = 1
    if defaults.get("pad_token_id") is not None:
        fields["pad_token_id"] = 0
    if "kv_lora_rank" in defaults:  # MLA: as many kv heads as heads
        fields["num_key_value_heads"] = fields["num_attention_heads"]
    fields.update(_one_layer_of_each_kind(defaults))
    return {**fields, **CENSUS_OVERRIDES.get(model_type, {})}


def census_config(model_type: str):
    """A tiny float32 config of any family with v5 fused experts: the tests' own where it has one (FAMILIES)."""
    if model_type in FAMILIES:
        return tiny_config(model_type)
    return transformers.AutoConfig.for_model(model_type, **census_fields(model_type))


def granite_scaled_logits_config():
    """A tiny GraniteMoE config whose logits are divided by logits_scaling: the fused CE cannot serve it."""
    if "granitemoe" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no granitemoe")
    return transformers.AutoConfig.for_model(
        "granitemoe",
        vocab_size=96,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        logits_scaling=4.0,
    )
