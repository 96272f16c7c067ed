"""Give expert-parallel tensors their global identity for DCP.

Under expert parallelism every ep rank holds *different* experts under the *same* parameter
name, as a DTensor sharded by FSDP2 over the expert-data-parallel dim only. DCP would take
those for replicas and keep one copy. While saving or loading, each such tensor (the parameter
and its optimizer moments) is re-wrapped, without copying, as a DTensor over an ("ep", "edp")
mesh whose global shape is the full [num_experts, ...] tensor: ep rank r owns expert block r,
split again over edp exactly as FSDP2 splits it (Shard(0)).
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.models.engine_state import engine_state
from workbench.parallel.fsdp import EXPERT_SHARD_ATTR


def expert_param_names(model: torch.nn.Module) -> set[str]:
    """Names of parameters that are rank-local expert shards (marked by models/mesh_build)."""
    return {name for name, p in model.named_parameters() if getattr(p, EXPERT_SHARD_ATTR, False)}


def _ep_edp_mesh(model: torch.nn.Module):
    state = engine_state(model)
    if state.ep_edp_mesh is not None:
        return state.ep_edp_mesh
    from torch.distributed.device_mesh import DeviceMesh

    mc = state.mesh
    ranks = torch.arange(mc.edp * mc.ep).reshape(mc.edp, mc.ep).T.contiguous()  # rank = edp_i * ep + ep_i
    state.ep_edp_mesh = DeviceMesh(state.device_mesh.device_type, ranks, mesh_dim_names=("ep", "edp"))
    return state.ep_edp_mesh


def _global_view(t: torch.Tensor, mesh, ep: int):
    from torch.distributed.tensor import DTensor, Shard

    local = t.to_local() if isinstance(t, DTensor) else t
    block_shape = tuple(t.shape)  # this ep rank's expert block (DTensor shape: FSDP's global)
    shape = torch.Size((block_shape[0] * ep, *block_shape[1:]))
    stride = torch.empty(0).new_empty(shape, device="meta").stride()
    return DTensor.from_local(local, mesh, [Shard(0), Shard(0)], run_check=False, shape=shape, stride=stride)


def globalize(model: torch.nn.Module, state: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of {"model": ..., "optim": ...} with expert tensors as global DTensor views."""
    names = expert_param_names(model)
    if not names:
        return state
    mesh, ep = _ep_edp_mesh(model), engine_state(model).mesh.ep
    model_sd = {
        k: (_global_view(v, mesh, ep) if k in names and isinstance(v, torch.Tensor) else v)
        for k, v in state["model"].items()
    }
    optim_sd = dict(state["optim"])
    per_param = {}
    for key, moments in optim_sd.get("state", {}).items():
        if key in names:
            moments = {
                m: (_global_view(v, mesh, ep) if isinstance(v, torch.Tensor) and v.dim() > 0 else v)
                for m, v in moments.items()
            }
        per_param[key] = moments
    if "state" in optim_sd:
        optim_sd["state"] = per_param
    return {"model": model_sd, "optim": optim_sd}
