"""Where FSDP2 goes: experts over the expert-data-parallel dim, everything else over dp."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from workbench.parallel.mesh import dense_mesh

# A plain (non-DTensor) parameter whose gradient is a rank-local shard of a larger logical tensor
# (e.g. this rank's experts under expert parallelism) carries this attribute: the ProcessGroup
# over which its squared gradient norm must be summed. DTensor parameters need no marker, their
# mesh says it; a DTensor that is additionally split over a group its mesh does not show (experts
# sharded by hand over ep, then FSDP over the expert-data-parallel dim) carries the marker too.
GRAD_NORM_GROUP_ATTR = "_workbench_grad_norm_group"
# An expert-parallel shard (this ep rank's block of a layer's experts, under the same name on every
# ep rank) carries this attribute, True: checkpoints give such tensors their global identity
# (train/expert_state.py). Set with GRAD_NORM_GROUP_ATTR but not read from it: a norm group may
# be given to a parameter that is not an expert shard.
EXPERT_SHARD_ATTR = "_workbench_expert_shard"


def _fsdp_kwargs(param_dtype: torch.dtype | None) -> dict:
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
    return {"mp_policy": mp} if mp is not None else {}


def _sum_gradients(modules: list[nn.Module]) -> None:
    """Gradients SUMMED, not averaged, across ranks (divide factor 1).

    The trainer normalizes each rank's loss by the global token count, so summing gives the
    exact gradient of the global loss, whatever dp and ep are.
    """
    for module in modules:
        # A plain SUM (FSDP skips the post-divide by 1): gloo has no PREMUL_SUM, and on NCCL this
        # is the same reduction the gloo equivalence tests verify.
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a Transformers model: the classes it names in `_no_split_modules`.

    Matched along each module's class hierarchy, so a layer is still found after fully_shard
    swapped its class for a subclass (FSDPQwen3MoeDecoderLayer).
    """
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if m is not model and any(cls.__name__ in names for cls in type(m).__mro__)]


def apply_fsdp_any(
    model: nn.Module,
    mesh: DeviceMesh,
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    inner: Callable[[nn.Module], Iterable[tuple[nn.Module, DeviceMesh]]] | None = None,
) -> nn.Module:
    """Shard a Transformers causal LM per decoder layer, then the root, over dp; gradients summed.

    `inner(layer)`: the (module, mesh) pairs inside a layer sharded before it, each over its own
    mesh (the engine's experts over the expert-data-parallel dim: models/mesh_build). Without it,
    experts of a model without the engine's blocks stay inside their layer's shard: they are
    replicated data-parallel parameters like any other, so plain FSDP2 over dp is exact for them.
    """
    kwargs = dict(reshard_after_forward=reshard_after_forward, **_fsdp_kwargs(param_dtype))
    dense = dense_mesh(mesh)
    sharded = []
    # Innermost first: fully_shard needs a nested block sharded before the block around it.
    for layer in reversed(decoder_layers(model)):
        for module, module_mesh in inner(layer) if inner is not None else ():
            sharded.append(fully_shard(module, mesh=module_mesh, **kwargs))
        sharded.append(fully_shard(layer, mesh=dense, **kwargs))
    sharded.append(fully_shard(model, mesh=dense, **{**kwargs, "reshard_after_forward": False}))
    _sum_gradients(sharded)
    return model
