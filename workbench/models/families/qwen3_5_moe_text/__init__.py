"""Qwen3.5-MoE's text model: the generic path plus the engine's Gated DeltaNet (its presets; the layout it shares
with Qwen3-Next is in families/gated_deltanet.py).

- mixer.py: the chunked gated delta rule, conv and gated norm in plain torch ops, compiled on CUDA
  (BackendConfig.mixer; models/mixer_gated_delta.py), and the decoder layer that hands it packed documents.
"""

from __future__ import annotations

from workbench.models.families.family import Family
from workbench.models.families.gated_deltanet import FAMILY_FIELDS, TEST_CONFIG
from workbench.models.families.qwen3_5_moe_text.presets import PRESETS


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine Gated DeltaNets where the resolved `backend` asks for them; how many."""
    # Transformers' Qwen3.5-MoE modeling module comes with it: imported when a model is built, not with the presets
    from workbench.models.families.qwen3_5_moe_text.mixer import use_engine_mixers

    return {"mixer": use_engine_mixers(model, backend.mixer)}


FAMILY = Family(
    model_type="qwen3_5_moe_text",
    name="Qwen3.5-MoE",
    presets=PRESETS,
    test_config=TEST_CONFIG,
    install_extras=install_extras,
    **FAMILY_FIELDS,
)
