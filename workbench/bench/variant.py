"""The same-initial-weights check every variant's row carries."""

from __future__ import annotations

import torch

from workbench.parallel.dist_utils import collective_device


def weight_fingerprint(model: torch.nn.Module) -> float:
    """Sum of every weight element over the world, in float64.

    FSDP shards and expert-parallel slices partition each tensor over the ranks, so summing each
    rank's local pieces counts every element once whatever the layout: equal fingerprints mean
    the anchor and the engine start from the same weights.
    """
    import torch.distributed as dist

    total = torch.zeros((), dtype=torch.float64)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            total += local.detach().double().sum().cpu()
    if dist.is_initialized() and dist.get_world_size() > 1 and _is_partitioned(model):
        total = total.to(collective_device())
        dist.all_reduce(total)
    return float(total)


def _is_partitioned(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())
