"""Ergo: the generic path plus its experts' per-expert norm, which ErgoExperts's own forward adds around Transformers'
decorated projections (experts.py reproduces it on the engine's rows); its tests' tiny config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workbench.models.families.family import Family

OWN_FORWARD = "ErgoExperts"  # the experts class whose own forward expert_rows reproduce (Family.experts_forwards)


def expert_rows(module, swiglu: str) -> Callable | None:
    """ErgoExperts's rows (projections, then the expert's norm) for an ErgoExperts module, else the generic rows."""
    # torch and the engine's experts come with a model: imported when one is built, not with the presets
    from workbench.models.families.ergo.experts import ergo_expert_rows
    from workbench.moe.hf_experts import own_forward_class

    own = own_forward_class(module)
    return ergo_expert_rows if own is not None and own.__name__ == OWN_FORWARD else None


TEST_CONFIG: dict[str, Any] = dict(
    num_hidden_layers=3,
    first_dense_intermediate_size=32,
    num_dense_blocks=1,
    moe_intermediate_size=16,
    shared_intermediate_size=32,
    num_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    pad_token_id=0,
    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
    mlp_layer_types=["dense", "sparse", "sparse"],
)

FAMILY = Family(
    model_type="ergo",
    name="Ergo",
    test_config=TEST_CONFIG,
    expert_rows=expert_rows,
    experts_forwards=(OWN_FORWARD,),
)
