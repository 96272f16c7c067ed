"""Lara-Mini: the generic path plus the engine's Gated DeltaNet (Transformers' LaraMiniGatedDeltaNet is Qwen3.5's:
the same projections, conv + SiLU, scalar decay per value head, l2-normed q and k, and gated RMSNorm). Its layers
mix Gated DeltaNet, sliding-window and full attention (plain Qwen3 attention: no query gate) before experts whose
shared expert is added without a gate.

- mixer.py: the chunked gated delta rule (models/mixer_gated_delta.py) and the decoder layer that hands it packed
  documents.
"""

from __future__ import annotations

from workbench.models.families.family import Family
from workbench.models.families.gated_deltanet import FAMILY_FIELDS, TEST_CONFIG


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine Gated DeltaNets where the resolved `backend` asks for them; how many."""
    # Transformers' Lara-Mini modeling module comes with it: imported when a model is built
    from workbench.models.families.lara_mini.mixer import use_engine_mixers

    return {"mixer": use_engine_mixers(model, backend.mixer)}


FAMILY = Family(
    model_type="lara_mini",
    name="Lara-Mini",
    # one layer of each kind, in the published pattern's order
    test_config=dict(
        TEST_CONFIG,
        num_hidden_layers=3,
        layer_types=["linear_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
    ),
    install_extras=install_extras,
    **dict(FAMILY_FIELDS, gated_query=False, shared_expert_gate=False),
)
