"""Every check of a RunConfig that depends on how many ranks run it, in one function.

The trainer runs it on each rank before any heavy work; `workbench finetune --nproc-per-node N`
runs the same function with N before torchrun starts a rank, so a config that cannot run on N
ranks is one line and exit code 2 from the launcher, never a traceback per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from workbench.backends import BackendConfig
from workbench.config import RunConfig
from workbench.config_checks import ConfigError
from workbench.models.fused_ce import resolve_for_config
from workbench.models.meta_model import meta_model
from workbench.models.mtp import check_mtp_loss
from workbench.train.loop_support import router_biases_to_update
from workbench.train.model_setup import check_lora, resolve_mesh
from workbench.train.stack_graphs import check_stack_graphs


@dataclass(frozen=True)
class WorldPlan:
    """What the checks decided for `world` ranks: the mesh, its data-parallel size, micro-batches, backends."""

    mesh: Any  # workbench.parallel.mesh.MeshConfig, None for one process
    dp: int
    accum: int
    backend: BackendConfig  # resolved: no "auto" left
    mesh_sizes: dict[str, int]


def check_optimizer_in_backward(train: Any, world: int, accum: int) -> None:
    """Refuse train.optimizer_in_backward where a parameter's gradient is not complete when its hook fires."""
    if train.optimizer_in_backward and (world > 1 or accum > 1):
        raise ConfigError(
            "train.optimizer_in_backward runs on one rank without gradient accumulation for now (a gradient "
            f"must be complete when its hook fires): this run has {world} rank{'s' if world != 1 else ''} and "
            f"{accum} micro-batch{'es' if accum != 1 else ''} per step"
        )


def check_world(rc: RunConfig, world: int, hf_config: Any, device: torch.device) -> WorldPlan:
    """Every refusal of `rc` on `world` ranks of `device` that needs no model, data or process group."""
    rc.data.check_fits(hf_config)  # before a seq_len-sized allocation fails far later
    mesh = resolve_mesh(rc.mesh, world, hf_config)
    check_lora(rc, hf_config)  # a LoRA target the model lacks (a meta model only)
    dp = mesh.dp if mesh is not None else world
    if rc.train.router_bias_update_rate > 0:  # a meta model only
        router_biases_to_update(meta_model(hf_config), hf_config, meta=True)
    if rc.train.mtp_loss_weight > 0:  # a meta model only
        check_mtp_loss(meta_model(hf_config), rc.train.mtp_loss_weight)
    layers = getattr(hf_config, "num_hidden_layers", None)
    recomputed = rc.train.activation_checkpointing_layers
    if recomputed is not None and layers is not None and recomputed > layers:
        raise ConfigError(
            f"train.activation_checkpointing_layers={recomputed} exceeds the model's {layers} decoder layers: "
            f"set it to at most {layers}, or to null (every layer)"
        )
    accum = rc.train.accumulation_steps(dp)
    check_optimizer_in_backward(rc.train, world, accum)
    mesh_sizes = mesh.to_dict() if mesh is not None else {"dp": 1, "ep": 1}
    # Resolved once, with the mesh's ep and what the model's logits allow (fused_ce): the run records the
    # backends the model is then built with.
    backend = resolve_for_config(rc.backend, device, mesh_sizes["ep"], hf_config)
    check_stack_graphs(rc.train, backend, world, accum, device)
    return WorldPlan(mesh=mesh, dp=dp, accum=accum, backend=backend, mesh_sizes=mesh_sizes)
