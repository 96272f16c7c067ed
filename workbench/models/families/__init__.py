"""The model families that add something to the generic engine path, one folder each, registered here.

Every Transformers v5 MoE family with fused experts runs on the generic path (models/generic.py) without a folder.
A family that adds something (presets, an engine attention or router, its own experts kernel, parameters the counts
must know, its tests' tiny config) has `models/families/<model_type>/` with a `FAMILY` record (family.Family) in
its `__init__.py`, and one line in REGISTERED below. The generic path, the parameter counts, the presets and the
tests ask `family_for(model_type)`; nothing outside a family's folder names it.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from workbench.models.families import (
    deepseek_v3,
    ergo,
    gpt_oss,
    granitemoehybrid,
    lara_mini,
    mixtral,
    nemotron_h,
    olmoe,
    qwen3_5_moe_text,
    qwen3_moe,
    qwen3_next,
    qwen4_exp_text,
)
from workbench.models.families.family import AttentionWidths, Family, LayerBlocks
from workbench.models.families.preset import Preset

# One line per family, in the Studio picker's order (its presets listed family by family).
REGISTERED: tuple[Family, ...] = (
    qwen3_moe.FAMILY,
    gpt_oss.FAMILY,
    deepseek_v3.FAMILY,
    mixtral.FAMILY,
    olmoe.FAMILY,
    nemotron_h.FAMILY,
    qwen3_5_moe_text.FAMILY,
    qwen3_next.FAMILY,
    ergo.FAMILY,
    granitemoehybrid.FAMILY,
    lara_mini.FAMILY,
    qwen4_exp_text.FAMILY,
)

# A model_type without a folder: the generic path adds nothing.
GENERIC = Family(model_type="", name="generic")


def _by_model_type(families: tuple[Family, ...]) -> Mapping[str, Family]:
    seen: dict[str, Family] = {}
    for family in families:
        if not family.model_type or family.model_type in seen:
            raise ValueError(f"families must name distinct model_types; {family.model_type!r} is empty or repeated")
        seen[family.model_type] = family
    return MappingProxyType(seen)


FAMILIES: Mapping[str, Family] = _by_model_type(REGISTERED)


def family_for(model_type: str | None) -> Family:
    """The registered family of `model_type`, or GENERIC (nothing added) for any other."""
    return FAMILIES.get(model_type or "", GENERIC)


def registered_presets() -> tuple[Preset, ...]:
    """Every registered family's presets, family by family in REGISTERED's order."""
    return tuple(p for family in REGISTERED for p in family.presets)


__all__ = [
    "FAMILIES",
    "GENERIC",
    "REGISTERED",
    "AttentionWidths",
    "Family",
    "LayerBlocks",
    "Preset",
    "family_for",
    "registered_presets",
]
