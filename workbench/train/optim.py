"""AdamW, the warmup + cosine schedule, and gradient clipping across the whole device mesh."""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

import torch
import torch.distributed as dist

# A plain (non-DTensor) parameter whose gradient is a rank-local shard of a larger logical tensor
# (e.g. this rank's experts under expert parallelism) carries this attribute: the ProcessGroup
# over which its squared gradient norm must be summed. DTensor parameters need no marker, their
# mesh says it; a DTensor that is additionally split over a group its mesh does not show (experts
# sharded by hand over ep, then FSDP over the expert-data-parallel dim) carries the marker too.
GRAD_NORM_GROUP_ATTR = "_workbench_grad_norm_group"


def build_optimizer(model: torch.nn.Module, train_cfg, device: torch.device) -> torch.optim.Optimizer:
    """AdamW (fused on CUDA); weight decay only on matrices, never on norms or biases."""
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": train_cfg.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    kwargs = {"fused": True} if device.type == "cuda" else {"foreach": False}
    return torch.optim.AdamW(groups, lr=train_cfg.lr, betas=train_cfg.betas, **kwargs)


def lr_factor(step: int, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> float:
    """Multiplier of the peak lr before optimizer step `step` (0-based): linear warmup, cosine decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


class WarmupCosine:
    """Picklable lr lambda (so LambdaLR.state_dict keeps it out of the way)."""

    def __init__(self, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> None:
        self.total_steps, self.warmup_steps, self.min_lr_ratio = total_steps, warmup_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        return lr_factor(step, self.total_steps, self.warmup_steps, self.min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, train_cfg) -> torch.optim.lr_scheduler.LambdaLR:
    """Warmup + cosine to lr * min_lr_ratio over train.steps."""
    fn = WarmupCosine(train_cfg.steps, train_cfg.warmup_steps, train_cfg.min_lr_ratio)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, fn)


def _is_dtensor(t: torch.Tensor) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return False
    return isinstance(t, DTensor)


def total_grad_norm(params: Iterable[torch.nn.Parameter]) -> torch.Tensor:
    """Global L2 norm of all gradients, the same value on every rank.

    DTensor grads (FSDP2 shards) are grouped by mesh and placement, and their norms reduced over
    that mesh with `full_tensor()`. Plain or DTensor grads marked with GRAD_NORM_GROUP_ATTR have
    their squared norm summed over the marked group. Unmarked plain grads are replicated and
    counted once.
    """
    buckets: dict[tuple, list[torch.Tensor]] = defaultdict(list)
    groups: dict[tuple, object] = {}
    for p in params:
        if p.grad is None:
            continue
        g = p.grad
        marker = getattr(p, GRAD_NORM_GROUP_ATTR, None)
        if _is_dtensor(g):
            key = ("dtensor", id(g.device_mesh), tuple(g.placements), id(marker))
        else:
            key = ("local", id(marker))
        buckets[key].append(g)
        groups[key] = marker
    squares: list[torch.Tensor] = []
    for key, grads in buckets.items():
        norms = [torch.linalg.vector_norm(g.detach(), 2.0, dtype=torch.float32) for g in grads]
        sq = torch.linalg.vector_norm(torch.stack(norms), 2.0) ** 2
        if _is_dtensor(sq):
            sq = sq.full_tensor()
        marker = groups[key]
        if marker is not None:
            dist.all_reduce(sq, op=dist.ReduceOp.SUM, group=marker)
        squares.append(sq)
    if not squares:
        return torch.zeros(())
    device = squares[0].device
    return torch.sqrt(torch.stack([s.to(device) for s in squares]).sum())


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """Scale all grads so their global norm is at most `max_norm`; return the norm before clipping."""
    params = [p for p in params if p.grad is not None]
    norm = float(total_grad_norm(params))
    if max_norm is not None and math.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return norm
