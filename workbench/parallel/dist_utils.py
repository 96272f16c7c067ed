"""Small torch.distributed helpers that also work with no process group (world of 1)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from workbench.config_checks import ConfigError
from workbench.devices import default_device


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def barrier() -> None:
    if initialized():
        dist.barrier()


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (without to_local's autograd overhead), or the tensor itself."""
    local = getattr(t, "_local_tensor", None)
    return t if local is None else local


def pick_device(kind: str = "auto") -> torch.device:
    """This rank's device (`kind` "auto": see `workbench.devices.default_device`), made current.

    "cpu" pins the CPU also where GPUs are visible (a float32 CPU reference on a GPU machine).
    """
    gloo = initialized() and "nccl" not in str(dist.get_backend()).lower()
    if kind == "cpu":
        if initialized() and not gloo:
            raise ConfigError(
                "model.device='cpu' needs a gloo process group (NCCL has no CPU collectives); use model.device='auto'"
            )
        return torch.device("cpu")
    if kind == "cuda" and (not torch.cuda.is_available() or gloo):
        raise ConfigError(
            "model.device='cuda' needs a CUDA GPU"
            + (" and an NCCL process group (this one is gloo)" if gloo else "")
            + "; use model.device='auto'"
        )
    device = default_device()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def collective_device() -> torch.device:
    """Where tensors for collectives must live for the active backend (nccl: cuda)."""
    if initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: list[float]) -> list[float]:
    """Element-wise sum over all ranks (float64)."""
    if not initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """`obj` from rank `src` on every rank."""
    if not initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_dicts(items: dict[str, Any]) -> dict[str, Any]:
    """The union of every rank's dict, on every rank (each rank's keys its own share of the work)."""
    if not initialized() or dist.get_world_size() == 1:
        return dict(items)
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return {k: v for part in parts for k, v in part.items()}


def broadcast_flag(flag: bool, src: int = 0) -> bool:
    """A boolean decided on `src`, the same on every rank."""
    if not initialized() or dist.get_world_size() == 1:  # nothing to agree on: no collective (a host sync on GPU)
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.broadcast(t, src=src)
    return bool(t.item())


def init_from_env() -> bool:
    """Initialize the default process group from torchrun's env when WORLD_SIZE > 1.

    nccl when CUDA is present, else gloo. Returns True if this call created the group.
    """
    if initialized() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        pick_device()
    dist.init_process_group(backend=backend)
    return True


def shutdown(created: bool) -> None:
    """Tear down a group this process created (barrier first: gloo may abort otherwise)."""
    if created and initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()
