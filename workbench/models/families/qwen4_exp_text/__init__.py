"""Qwen4-Exp's text model: the generic path plus the engine's Gated DeltaNet (Transformers' Qwen4ExpTextGatedDeltaNet
is Qwen3.5's: the same projections, conv + SiLU, scalar decay per value head, l2-normed q and k and gated RMSNorm,
whose gate its config may set to sigmoid instead: output_gate_type, refused for the engine's mixer).

Packed documents do not reach its mixer: Qwen4ExpTextModel hands its layers no position ids, so each row runs as one
sequence, as in Transformers' own path. The parameter counts know its Gated DeltaNet and indexed attention layers;
its hyper-connections, per-layer n-gram embeddings and attention indexer are not counted.

- mixer.py: the chunked gated delta rule (models/mixer_gated_delta.py).
"""

from __future__ import annotations

from workbench.models.families.family import Family
from workbench.models.families.gated_deltanet import FAMILY_FIELDS, TEST_CONFIG


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine Gated DeltaNets where the resolved `backend` asks for them; how many."""
    # Transformers' Qwen4-Exp modeling module comes with it: imported when a model is built
    from workbench.models.families.qwen4_exp_text.mixer import use_engine_mixers

    return {"mixer": use_engine_mixers(model, backend.mixer)}


FAMILY = Family(
    model_type="qwen4_exp_text",
    name="Qwen4-Exp",
    test_config=dict(
        TEST_CONFIG,  # its config renames full_attention its own attention type (indexed_attention in 5.25)
        hc_lowrank=8,
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=8,
        indexer_budget=8,
        indexer_compress_ratio=4,
    ),
    install_extras=install_extras,
    **FAMILY_FIELDS,
)
