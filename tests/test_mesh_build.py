"""models/mesh_build's FSDP2 wrap of the generic path: what it refuses (the sharding itself: test_expert_parallel)."""

from __future__ import annotations

import pytest
from dist_utils import run_ranks
from generic_families import tiny_config


def _wrap_worker(rank, world, no_split):
    from workbench.models.auto import AutoModelForCausalLM
    from workbench.models.mesh_build import apply_fsdp_generic
    from workbench.parallel.mesh import MeshConfig

    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), device="cpu")
    if no_split is not None:
        model._no_split_modules = no_split  # the experts now lie outside every "decoder layer"
    try:
        apply_fsdp_generic(model, MeshConfig(dp=2, ep=2).build("cpu"))
    except RuntimeError as err:
        return str(err)
    return "sharded"


@pytest.mark.slow
def test_experts_outside_the_decoder_layers_are_refused():
    refused = run_ranks(_wrap_worker, 2, ["MixtralAttention"], timeout=120)
    assert all("2 of 2 experts modules lie outside the decoder layers" in m for m in refused), refused
    assert run_ranks(_wrap_worker, 2, None, timeout=120) == ["sharded", "sharded"]
