"""GraniteMoE-Hybrid (Granite 4.0): the generic path plus the engine's Mamba2 mixer (its tests' config).

Its GraniteMoeHybridMambaLayer is the Mamba2 of Nemotron-H with other config names: in_proj to (z, x|B|C, dt),
a depthwise causal conv with the config's hidden_act (SiLU), the chunked SSD scan with dt_bias, A_log, D and
time_step_limit, a gated group RMSNorm (gate before the norm, mamba_n_groups groups) and out_proj; so the engine's
mixer (models/mixer_mamba2.py) runs it unchanged, reading the module's own fields.

- mixer.py: the class swaps of the mixer and of the decoder layer that hands it packed documents.
"""

from __future__ import annotations

from typing import Any

from workbench.models.families.family import Family, LayerBlocks


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine Mamba2 mixers where the resolved `backend` asks for them; how many."""
    # Transformers' GraniteMoE-Hybrid modeling module comes with it: imported when a model is built
    from workbench.models.families.granitemoehybrid.mixer import use_engine_mixers

    return {"mixer": use_engine_mixers(model, backend.mixer)}


def layer_blocks(cfg, moe_flags: list[bool]) -> tuple[LayerBlocks, ...]:
    """A Mamba2 ('linear_attention') or attention in each layer, before its MoE (its shared MLP the shared expert)
    or, with no experts, its dense MLP."""
    mixers = {"linear_attention": "mamba2", "attention": "attention", "full_attention": "attention"}
    mlp = "moe" if (getattr(cfg, "num_local_experts", 0) or 0) > 0 else "dense"
    return tuple(LayerBlocks(mixers[t], mlp) for t in cfg.layers_block_type)


TEST_CONFIG: dict[str, Any] = dict(
    layer_types=["linear_attention", "full_attention"],
    intermediate_size=16,
    shared_intermediate_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_n_groups=2,
    mamba_d_state=8,
    mamba_chunk_size=4,
    # Granite's scalings, away from 1 so a path that skipped one would show
    embedding_multiplier=1.5,
    residual_multiplier=0.7,
    attention_multiplier=0.2,
    logits_scaling=2.0,
)

FAMILY = Family(
    model_type="granitemoehybrid",
    name="GraniteMoE-Hybrid",
    test_config=TEST_CONFIG,
    install_extras=install_extras,
    layer_blocks=layer_blocks,
)
