"""A model preset: the architecture of a published MoE model (random init), or a tiny twin of its family.

Each preset names its Transformers `model_type` and builds that family's own config class through
`transformers.AutoConfig.for_model` (workbench/presets.build_preset_config), so a preset of any family is plain data.
The numbers of the full-size presets are those of the published config.json of the model named in `source`; the
tiny ones keep the family's structure (MLA, shared experts, sliding windows, biases) at widths that train in seconds
on a CPU and use the shipped 512-token tokenizer. Each family folder (models/families/<model_type>/presets.py) holds
its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from workbench.config_checks import ConfigError

# The shipped tokenizer's vocabulary size (tests/test_data.py checks it matches the files).
TINY_VOCAB_SIZE = 512

# Shared by every tiny preset: the shipped tokenizer's ids, a short context, untied embeddings.
# Widths are multiples of 8 so the bf16 grouped_mm path accepts them on GPU too.
TINY_COMMON = dict(
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


def with_num_layers(fields: dict[str, Any], layers: int) -> dict[str, Any]:
    """A preset's fields at `layers` decoder layers: num_hidden_layers, from which the config derives any per-layer
    list (GPT-OSS's sliding/full layer_types, Qwen3.5's and Qwen3-Next's linear/full layer_types)."""
    return {**fields, "num_hidden_layers": layers}


def with_pattern_prefix(key: str) -> Callable[[dict[str, Any], int], dict[str, Any]]:
    """The depth rule of a preset whose layers are one character each of the pattern string `fields[key]`
    (Nemotron-H's hybrid_override_pattern): its first `layers` characters, so the family's pattern is kept."""

    def rule(fields: dict[str, Any], layers: int) -> dict[str, Any]:
        pattern = fields[key]
        if layers > len(pattern):
            raise ConfigError(
                f"layers={layers} exceeds the {len(pattern)} layers of this preset's pattern {pattern!r}; "
                f"use {len(pattern)} or fewer"
            )
        return {**fields, key: pattern[:layers], "num_hidden_layers": layers}

    return rule


@dataclass(frozen=True)
class Preset:
    """A named architecture: the Transformers model_type and the config fields of that family."""

    name: str
    model_type: str
    family: str  # shown in the Studio's picker
    fields: Callable[[], dict[str, Any]]  # a fresh dict per call: callers may change it
    source: str = ""  # the published model whose config.json the numbers come from ("" = tiny)
    # (fields, layers) -> the fields at that depth, keeping the family's layer pattern
    depth: Callable[[dict[str, Any], int], dict[str, Any]] = with_num_layers

    def __post_init__(self) -> None:
        if not self.name or not self.model_type:
            raise ValueError(f"a preset needs a name and a model_type, got {self.name!r}, {self.model_type!r}")

    @property
    def layers(self) -> int:
        """The preset's decoder depth."""
        return int(self.fields()["num_hidden_layers"])
