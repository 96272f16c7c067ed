"""A model's whole state dict on the CPU from any mesh: every tensor unsharded, the experts gathered over ep."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from workbench.models.engine_state import engine_state
from workbench.moe.hf_experts import engine_experts_modules


def full_state_dict(model: nn.Module, to_rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the unsharded model on the CPU (experts gathered over ep); collective.

    One tensor at a time: each is unsharded (and its experts gathered over ep) on the device,
    copied to the CPU and freed before the next, so no rank ever holds the whole model on its
    GPU. With `to_rank0_only` the other ranks return an empty dict (they only take part).
    """
    from torch.distributed.tensor import DTensor

    state = engine_state(model)
    mesh = state.mesh
    ep_group = state.device_mesh.get_group("ep") if mesh is not None and mesh.ep > 1 else None
    expert_keys = {
        f"{name}.{pname}"
        for name, module in engine_experts_modules(model)
        for pname in module.plan.layout.param_names()
    }
    keep = not to_rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    state = {}
    for key, value in model.state_dict().items():  # the same keys in the same order on every rank
        full = value.full_tensor() if isinstance(value, DTensor) else value.detach()
        if ep_group is not None and key in expert_keys:
            parts = [torch.empty_like(full) for _ in range(mesh.ep)]
            dist.all_gather(parts, full.contiguous(), group=ep_group)
            full = torch.cat(parts)
        if keep:
            state[key] = full.detach().cpu()
        del full
    return state
