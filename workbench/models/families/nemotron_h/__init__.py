"""Nemotron-H (Nemotron 3 Nano): the generic path plus the engine's Mamba2 mixer (its presets, its tests' config).

- mixer.py: the chunked SSD scan, conv and gated norm in plain torch ops, compiled on CUDA (BackendConfig.mixer;
  models/mixer_mamba2.py), and the decoder block that hands it packed documents.
"""

from __future__ import annotations

from typing import Any

from workbench.models.families.family import Family, LayerBlocks
from workbench.models.families.nemotron_h.presets import PRESETS


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine Mamba2 mixers where the resolved `backend` asks for them; how many."""
    # Transformers' Nemotron-H modeling module comes with it: imported when a model is built, not with the presets
    from workbench.models.families.nemotron_h.mixer import use_engine_mixers

    return {"mixer": use_engine_mixers(model, backend.mixer)}


# Transformers' names for the blocks of hybrid_override_pattern (M, *, E, -), older ones first
NEMOTRON_BLOCKS = {
    "mamba": LayerBlocks("mamba2", None),
    "linear_attention": LayerBlocks("mamba2", None),
    "attention": LayerBlocks("attention", None),
    "full_attention": LayerBlocks("attention", None),
    "moe": LayerBlocks(None, "moe"),
    "mlp": LayerBlocks(None, "dense"),
}


def layer_blocks(cfg, moe_flags: list[bool]) -> tuple[LayerBlocks, ...]:
    """One block per layer, as its pattern says: a Mamba2 mixer, attention, an MoE or a relu² MLP."""
    return tuple(NEMOTRON_BLOCKS[kind] for kind in cfg.layers_block_type)


TEST_CONFIG: dict[str, Any] = dict(
    hybrid_override_pattern="ME*E",
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    n_groups=2,
    chunk_size=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=16,
    intermediate_size=32,
)

FAMILY = Family(
    model_type="nemotron_h",
    name="Nemotron-H",
    presets=PRESETS,
    test_config=TEST_CONFIG,
    install_extras=install_extras,
    layer_blocks=layer_blocks,
    gated_mlps=False,
)
