"""Where FSDP2 goes: experts over the expert-data-parallel dim, everything else over dp."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from workbench.moe.layer import MoEBlock
from workbench.parallel.mesh import dense_mesh


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True) -> nn.Module:
    """Shard each decoder layer (and its experts separately), then the root.

    Gradients are SUMMED, not averaged, across ranks (divide factor 1): the trainer normalizes
    each rank's loss by the global token count, so summing gives the exact gradient of the
    global loss for dense and expert parameters alike, whatever dp and ep are.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    kwargs = {"mp_policy": mp} if mp is not None else {}
    dense = dense_mesh(mesh)
    sharded = []
    for layer in model.model.layers:
        if isinstance(layer.mlp, MoEBlock):
            sharded.append(fully_shard(layer.mlp.experts, mesh=mesh["edp"],
                                       reshard_after_forward=reshard_after_forward, **kwargs))
        sharded.append(fully_shard(layer, mesh=dense, reshard_after_forward=reshard_after_forward,
                                   **kwargs))
    sharded.append(fully_shard(model, mesh=dense, reshard_after_forward=False, **kwargs))
    for module in sharded:
        # A plain SUM (FSDP skips the post-divide by 1): gloo has no PREMUL_SUM, and on NCCL this
        # is the same reduction the gloo equivalence tests verify.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)
    return model
