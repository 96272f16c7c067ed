"""GPT-OSS's presets: a tiny twin and gpt-oss-20b.

Only fields that exist in the config classes of both Transformers 5.17 and 5.24 are set (GPT-OSS's `swiglu_limit`
/ `swiglu_alpha` are 5.24-only fields, so they are left at the family's defaults).
"""

from __future__ import annotations

from typing import Any

from workbench.models.families.preset import TINY_COMMON, Preset


def _yarn(factor: float, original: int) -> dict[str, Any]:
    # GPT-OSS's YaRN RoPE; written out rather than left to the class default, which may change.
    return dict(
        rope_type="yarn",
        factor=factor,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=original,
        rope_theta=150000.0,
    )


def _tiny_gpt_oss() -> dict[str, Any]:
    # Alternating sliding (window 16, shorter than the default seq_len 128) and full attention layers
    # (the config derives layer_types from num_hidden_layers), attention sinks, biases everywhere.
    return dict(
        TINY_COMMON,
        intermediate_size=32,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=16,
        attention_bias=True,
        rope_parameters=_yarn(4.0, 512),
        router_aux_loss_coef=0.01,
    )


def _gpt_oss_20b() -> dict[str, Any]:
    return dict(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_hidden_layers=24,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        num_local_experts=32,
        num_experts_per_tok=4,
        sliding_window=128,
        attention_bias=True,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters=_yarn(32.0, 4096),
        tie_word_embeddings=False,
        router_aux_loss_coef=0.9,
        eos_token_id=200002,
        pad_token_id=199999,
    )


PRESETS = (
    Preset("tiny-gpt-oss", "gpt_oss", "GPT-OSS", _tiny_gpt_oss),
    Preset("gpt-oss-20b", "gpt_oss", "GPT-OSS", _gpt_oss_20b, "openai/gpt-oss-20b"),
)
