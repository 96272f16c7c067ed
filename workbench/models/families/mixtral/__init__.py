"""Mixtral: the generic path as it is; the family adds its presets and its tests' tiny config."""

from __future__ import annotations

from workbench.models.families.family import Family
from workbench.models.families.mixtral.presets import PRESETS

FAMILY = Family(
    model_type="mixtral",
    name="Mixtral",
    presets=PRESETS,
    test_config=dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2),
)
