"""What a built variant hands the timing loop: model, optimizer and its loss convention."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


@dataclass
class Prepared:
    """A built variant on this rank.

    `forward(ids)` returns (objective, ce_part, aux_part) for this rank's rows. `reduce` says how
    the per-rank parts combine into the global batch's value: "mean" for the anchor (each rank's
    loss is its local mean; FSDP averages gradients), "sum" for the engine (each rank's loss is
    normalized by the global token count; gradients are summed).
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    forward: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    reduce: str
    setup: dict[str, Any] = field(default_factory=dict)
    context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


def adamw(model: torch.nn.Module, lr: float, device: torch.device, engine: bool = False,
          precision: str = "auto", seed: int = 0) -> torch.optim.Optimizer:
    """AdamW with one param group per DTensor mesh: torch's (fused on CUDA) for the anchor, as the
    issue prescribes; for the engine the optimizer its trainer uses ("adamw": Triton on CUDA) in
    train.precision `precision` (the anchor's torch AdamW: plain bf16).

    Fused/foreach kernels take one list per group; under expert parallelism the experts live on
    another mesh than the dense weights, and DTensor refuses lists that mix meshes.
    """
    from workbench.train.optim import make_adamw

    groups: dict[Any, list] = defaultdict(list)
    for p in model.parameters():
        if p.requires_grad:
            mesh = getattr(p, "device_mesh", None)
            groups[id(mesh) if mesh is not None else None].append(p)
    return make_adamw([{"params": ps} for ps in groups.values()], "adamw" if engine else "adamw_torch", device, lr,
                      precision=precision, seed=seed)


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
        from workbench.parallel.dist_utils import collective_device

        total = total.to(collective_device())
        dist.all_reduce(total)
    return float(total)


def _is_partitioned(model: torch.nn.Module) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())
