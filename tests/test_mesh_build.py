"""models/mesh_build's FSDP2 wrap of the generic path: what it refuses (the sharding itself: test_expert_parallel)."""

from __future__ import annotations

import pytest
from generic_families import tiny_config
from launch_utils import run_ranks


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


def _expert_shards_worker(rank, world):
    from workbench.models.auto import AutoModelForCausalLM
    from workbench.moe.hf_experts import engine_experts_modules
    from workbench.parallel.mesh import MeshConfig
    from workbench.train.expert_state import expert_param_names

    model = AutoModelForCausalLM.from_config(tiny_config("mixtral"), mesh=MeshConfig(dp=2, ep=2), seed=0)
    experts = {f"{name}.{p}" for name, m in engine_experts_modules(model) for p, _ in m.named_parameters(recurse=False)}
    return sorted(expert_param_names(model)), sorted(experts)


def test_expert_shards_carry_their_own_marker():
    from torch import nn

    from workbench.parallel.fsdp import EXPERT_SHARD_ATTR, GRAD_NORM_GROUP_ATTR
    from workbench.train.expert_state import expert_param_names

    # A grad-norm group alone (clipping) does not make a parameter an ep shard: checkpoints read the marker.
    plain = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    setattr(plain[0].weight, GRAD_NORM_GROUP_ATTR, object())
    setattr(plain[1].weight, EXPERT_SHARD_ATTR, True)
    assert expert_param_names(plain) == {"1.weight"}
    for marked, experts in run_ranks(_expert_shards_worker, 2, timeout=120):
        assert marked == experts and marked, (marked, experts)  # the mesh build marks exactly the experts
