"""Which mesh a run builds for its rank count: the RunConfig's, or the default one (dp = world, ep = world where it
divides the experts), checked against the model. The trainer, the bench and the run plan (workbench.plan) resolve it
here."""

from __future__ import annotations

from typing import Any

from workbench.config_checks import ConfigError
from workbench.models.generic import UnsupportedModelError, has_fused_experts
from workbench.models.mesh_build import check_mesh_for_model
from workbench.parallel.mesh import MeshConfig
from workbench.params import num_experts as config_num_experts


def resolve_mesh(mesh: Any, world_size: int, hf_config: Any):
    """The MeshConfig to build, or None for one process.

    None in the RunConfig means: dp = world size, and, for a model with engine MoE blocks, ep =
    world size when it divides the expert count (else ep = 1). An explicit mesh is validated
    against the world and the model: ep > 1 needs experts the engine can split.
    """
    experts = config_num_experts(hf_config)
    try:  # a MoE model whose experts the engine cannot run is refused before the run directory exists
        engine = has_fused_experts(hf_config)
    except UnsupportedModelError as err:
        raise ConfigError(str(err)) from err
    if mesh is None:
        if world_size == 1:
            return None
        ep = world_size if engine and experts and experts % world_size == 0 else 1
        mesh = MeshConfig(dp=world_size, ep=ep)
    try:
        check_mesh_for_model(mesh, hf_config)
        mesh.validate(world_size, experts)
    except ValueError as err:
        raise ConfigError(f"mesh {mesh} does not fit this run: {err}") from err
    return mesh
