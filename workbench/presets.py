"""Model presets: the architectures of published MoE models (random init) and a tiny twin per family.

Each family folder holds its own (models/families/<model_type>/presets.py, a `Preset` each:
models/families/preset.py); this module lists every registered family's, in the registry's order, and builds a
preset's config through `transformers.AutoConfig.for_model`.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from workbench.models.families import registered_presets
from workbench.models.families.preset import TINY_VOCAB_SIZE, Preset

__all__ = ["PRESETS", "TINY_VOCAB_SIZE", "Preset", "build_preset_config"]


def _presets(*presets: Preset) -> Mapping[str, Preset]:
    names = [p.name for p in presets]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"preset names must be unique across families; repeated: {repeated}")
    return MappingProxyType({p.name: p for p in presets})


# Read-only: the picker lists them in this order (families together, tiny first).
PRESETS: Mapping[str, Preset] = _presets(*registered_presets())


def build_preset_config(name: str, layers: int | None = None):
    """The family's own transformers config for preset `name`, with `layers` decoder layers if given.

    Raises KeyError for an unknown name (workbench.config.preset_config turns it into a ConfigError), ConfigError for
    more layers than a preset's layer pattern has.
    """
    from transformers import AutoConfig

    preset = PRESETS[name]
    fields = preset.fields() if layers is None else preset.depth(preset.fields(), layers)
    return AutoConfig.for_model(preset.model_type, **fields)
