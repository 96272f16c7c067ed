"""Model presets of every family: config classes, parameter counts, a few training steps."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from workbench.config import PRESETS, ConfigError, ModelConfig, RunConfig, preset_config
from workbench.moe.hf_experts import is_fused_experts
from workbench.params import num_experts, param_counts

TINY = [name for name in PRESETS if name.startswith("tiny")]
FAMILY_CLASSES = {
    "qwen3_moe": "Qwen3MoeConfig",
    "gpt_oss": "GptOssConfig",
    "deepseek_v3": "DeepseekV3Config",
    "mixtral": "MixtralConfig",
    "olmoe": "OlmoeConfig",
    "nemotron_h": "NemotronHConfig",
    "qwen3_5_moe_text": "Qwen3_5MoeTextConfig",
    "qwen3_next": "Qwen3NextConfig",
}


def on_meta(cfg):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def test_every_family_has_a_full_size_and_a_tiny_preset():
    families = {p.model_type for p in PRESETS.values()}
    assert families == set(FAMILY_CLASSES)
    for family in families:
        names = [p.name for p in PRESETS.values() if p.model_type == family]
        assert any(n.startswith("tiny") for n in names) and any(not n.startswith("tiny") for n in names), names
    assert [p.model_type for p in PRESETS.values() if p.name == "tiny"] == ["qwen3_moe"]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_builds_its_familys_own_config_class(name):
    cfg = preset_config(name)
    preset = PRESETS[name]
    assert cfg.model_type == preset.model_type and type(cfg).__name__ == FAMILY_CLASSES[preset.model_type]
    assert num_experts(cfg) > 0 and cfg.num_hidden_layers == preset.layers
    short = preset_config(name, layers=2)
    assert type(short) is type(cfg) and short.num_hidden_layers == 2
    if preset.model_type == "gpt_oss":  # per-layer attention types follow the depth
        assert short.layer_types == ["sliding_attention", "full_attention"]
    assert ModelConfig(preset=name, layers=3).hf_config().num_hidden_layers == 3


def test_unknown_preset_and_bad_layers_are_config_errors():
    with pytest.raises(ConfigError, match=r"unknown model preset 'gpt-oss-120b'; presets: \["):
        preset_config("gpt-oss-120b")
    with pytest.raises(ConfigError, match="layers must be an integer >= 1"):
        preset_config("tiny-mixtral", layers=0)


# Tiny presets plus variants that take the other branches of the counter (MLA without a q rank,
# attention biases, tied embeddings).
COUNT_CASES = [(name, {}) for name in TINY] + [
    ("tiny-deepseek-v3", dict(q_lora_rank=None, attention_bias=True)),
    ("tiny-mixtral", dict(tie_word_embeddings=True)),
    ("tiny-olmoe", dict(attention_bias=True)),
]


@pytest.mark.parametrize("name,changes", COUNT_CASES)
def test_param_counts_equal_the_real_modules(name, changes):
    cfg = preset_config(name, layers=3)
    for key, value in changes.items():
        setattr(cfg, key, value)
    model = on_meta(cfg)
    counts = param_counts(cfg)
    experts = [m for m in model.modules() if is_fused_experts(m)]  # under .mlp, Nemotron-H's under .mixer
    routed = sum(p.numel() for m in experts for p in m.parameters())
    assert counts.total == sum(p.numel() for p in model.parameters())
    assert counts.experts == routed
    assert counts.moe_layers == len(experts)
    one_expert = routed // (len(experts) * counts.num_experts)
    assert counts.active == counts.total - counts.experts + counts.moe_layers * counts.top_k * one_expert


# (preset, total, active, how the publisher counts "active"): the figures on each model card.
PUBLISHED = [
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, "all"),
    ("gpt-oss-20b", 20.9e9, 3.6e9, "no_embed"),  # OpenAI leaves the embedding table out
    ("moonlight-16b-a3b", 16.0e9, 2.9e9, "all"),  # "16B total, 3B activated"
    ("mixtral-8x7b", 46.7e9, 12.9e9, "all"),
    ("olmoe-1b-7b", 6.9e9, 1.3e9, "all"),
]


@pytest.mark.parametrize("name,total,active,convention", PUBLISHED)
def test_full_size_presets_have_the_published_sizes(name, total, active, convention):
    cfg = preset_config(name)
    counts = param_counts(cfg)
    assert counts.total == sum(p.numel() for p in on_meta(cfg).parameters())
    assert abs(counts.total / total - 1) < 0.01, counts.total
    quoted = counts.active - counts.embed if convention == "no_embed" else counts.active
    assert abs(quoted / active - 1) < 0.03, quoted


@pytest.mark.slow
@pytest.mark.parametrize("name", [n for n in TINY if n != "tiny"])
def test_tiny_family_preset_finetunes_on_cpu(name, tmp_path):
    """`workbench finetune` with the preset: the vanilla-Transformers path (ep=1) trains, loss falls."""
    from workbench.train import finetune

    result = finetune(
        RunConfig.demo(
            model=ModelConfig(preset=name),
            output_dir=str(tmp_path),
            train__steps=3,
            train__lr=1e-2,
            train__warmup_steps=0,
            train__save_final_checkpoint=False,
        )
    )
    losses = result["losses"]
    assert result["state"] == "completed" and len(losses) == 3, result
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses


def test_layers_of_a_checkpoint_with_per_layer_types_keep_their_pattern(tmp_path):
    preset_config("tiny-gpt-oss", layers=4).save_pretrained(tmp_path)
    cfg = ModelConfig(preset=None, path=str(tmp_path), layers=3).hf_config()
    assert cfg.num_hidden_layers == 3 and cfg.layer_types == [
        "sliding_attention",
        "full_attention",
        "sliding_attention",
    ]
    on_meta(cfg)  # builds: one attention type per layer
    with pytest.raises(ConfigError, match=r"model.layers \(6\) exceeds the 4 layers of .*use 4 or fewer"):
        ModelConfig(preset=None, path=str(tmp_path), layers=6).hf_config()
