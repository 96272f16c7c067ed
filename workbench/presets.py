"""Model presets: the architectures of published MoE models (random init) and a tiny twin per family.

Each preset names its Transformers `model_type` and builds that family's own config class through
`transformers.AutoConfig.for_model`, so a preset of any family is plain data. The numbers of the
full-size presets are those of the published config.json of the model named in `source`; the
tiny ones keep the family's structure (MLA, shared experts, sliding windows, biases) at widths that
train in seconds on a CPU and use the shipped 512-token tokenizer.

Only fields that exist in the config classes of both Transformers 5.17 and 5.24 are set (GPT-OSS's
`swiglu_limit` / `swiglu_alpha` are 5.24-only fields, so they are left at the family's defaults).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

# The shipped tokenizer's vocabulary size (tests/test_data.py checks it matches the files).
TINY_VOCAB_SIZE = 512

# Shared by every tiny preset: the shipped tokenizer's ids, a short context, untied embeddings.
# Widths are multiples of 8 so the bf16 grouped_mm path accepts them on GPU too.
_TINY_COMMON = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=2048,
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=2,
    pad_token_id=0,
)


@dataclass(frozen=True)
class Preset:
    """A named architecture: the Transformers model_type and the config fields of that family."""

    name: str
    model_type: str
    family: str  # shown in the Studio's picker
    fields: Callable[[], dict[str, Any]]  # a fresh dict per call: callers may change it
    source: str = ""  # the published model whose config.json the numbers come from ("" = tiny)

    def __post_init__(self) -> None:
        if not self.name or not self.model_type:
            raise ValueError(f"a preset needs a name and a model_type, got {self.name!r}, {self.model_type!r}")

    @property
    def layers(self) -> int:
        """The preset's decoder depth."""
        return int(self.fields()["num_hidden_layers"])


def _tiny() -> dict[str, Any]:
    return dict(
        _TINY_COMMON,
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


def _tiny_mixtral() -> dict[str, Any]:
    # Mixtral's expert width is intermediate_size (it has no dense layers).
    return dict(
        _TINY_COMMON,
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


def _tiny_olmoe() -> dict[str, Any]:
    # OLMoE: full multi-head attention with q/k norms over all heads, no top-k renormalization.
    return dict(
        _TINY_COMMON,
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
        _TINY_COMMON,
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


def _tiny_deepseek_v3() -> dict[str, Any]:
    # DeepSeek-V3's structure: MLA with a low-rank q (q_lora_rank) and kv, one dense first layer, shared
    # experts, and group-limited routing that actually limits (2 groups, tokens pick from 1).
    return dict(
        _TINY_COMMON,
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


def _presets(*presets: Preset) -> Mapping[str, Preset]:
    return MappingProxyType({p.name: p for p in presets})


# Read-only: the picker lists them in this order (families together, tiny first).
PRESETS: Mapping[str, Preset] = _presets(
    Preset("tiny", "qwen3_moe", "Qwen3-MoE", _tiny),
    Preset("qwen3-30b-a3b", "qwen3_moe", "Qwen3-MoE", _qwen3_30b_a3b, "Qwen/Qwen3-30B-A3B"),
    Preset("tiny-gpt-oss", "gpt_oss", "GPT-OSS", _tiny_gpt_oss),
    Preset("gpt-oss-20b", "gpt_oss", "GPT-OSS", _gpt_oss_20b, "openai/gpt-oss-20b"),
    Preset("tiny-deepseek-v3", "deepseek_v3", "DeepSeek-V3", _tiny_deepseek_v3),
    Preset("moonlight-16b-a3b", "deepseek_v3", "DeepSeek-V3", _moonlight_16b_a3b, "moonshotai/Moonlight-16B-A3B"),
    Preset("tiny-mixtral", "mixtral", "Mixtral", _tiny_mixtral),
    Preset("mixtral-8x7b", "mixtral", "Mixtral", _mixtral_8x7b, "mistralai/Mixtral-8x7B-v0.1"),
    Preset("tiny-olmoe", "olmoe", "OLMoE", _tiny_olmoe),
    Preset("olmoe-1b-7b", "olmoe", "OLMoE", _olmoe_1b_7b, "allenai/OLMoE-1B-7B-0924"),
)


def build_preset_config(name: str, layers: int | None = None):
    """The family's own transformers config for preset `name`, with `layers` decoder layers if given.

    Raises KeyError for an unknown name (workbench.config.preset_config turns it into a ConfigError).
    """
    from transformers import AutoConfig

    preset = PRESETS[name]
    fields = preset.fields()
    if layers is not None:
        # Per-layer lists the config derives (GPT-OSS layer_types) follow num_hidden_layers.
        fields["num_hidden_layers"] = layers
    return AutoConfig.for_model(preset.model_type, **fields)
