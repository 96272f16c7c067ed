"""What the Trainer needs beside its step: user callbacks, the run directory, model probes, collectives."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workbench.config import RunConfig
from workbench.config_checks import ConfigError
from workbench.moe.bias_update import RouterBiasError, check_router_bias
from workbench.moe.routed_load import load_counters, pop_routed_load
from workbench.parallel import dist_utils as du
from workbench.runs.run_dir import RunDir, default_runs_dir, new_run_id
from workbench.train.data_batch import Batch


class Callbacks:
    """Calls optional hooks on user callback objects."""

    def __init__(self, callbacks: list | None) -> None:
        self.items = list(callbacks or [])

    def call(self, name: str, arg: Any) -> None:
        """Call hook `name` of every callback that has it."""
        for cb in self.items:
            fn = getattr(cb, name, None)
            if fn is not None:
                fn(arg)

    def every_step(self) -> bool:
        """Whether a callback needs each step's record right after it (`collect_every_step`, the profiler)."""
        return any(bool(getattr(cb, "collect_every_step", False)) for cb in self.items)

    def should_stop(self) -> bool:
        """Whether any callback asks the run to stop."""
        return any(bool(cb.should_stop()) for cb in self.items if hasattr(cb, "should_stop"))


def open_run_dir(rc: RunConfig, extra: dict[str, Any]) -> RunDir:
    """Rank 0 creates the run directory; every rank gets it (or rank 0's error)."""
    result: Any = None
    if du.rank() == 0:
        try:
            runs_dir = Path(rc.output_dir).expanduser() if rc.output_dir else default_runs_dir()
            config = {**rc.to_dict(), **extra}
            config["run_id"] = rc.run_id or new_run_id()
            result = str(RunDir.create(runs_dir, config["run_id"], config).path)
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            result = err
    result = du.broadcast_object(result)
    if isinstance(result, BaseException):
        raise result
    return RunDir(Path(result))


def all_reduce(t: torch.Tensor) -> torch.Tensor:
    """`t` summed over all ranks, queued on the device under NCCL (no host wait); `t` itself on one rank."""
    if not du.initialized() or du.world_size() == 1:
        return t
    import torch.distributed as dist

    t = t.to(du.collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    """`batch` in slices of `size` sequences."""
    return [batch.slice(i, i + size) for i in range(0, len(batch), size)]


def is_parallel(model: torch.nn.Module) -> bool:
    """Whether any parameter of `model` is a DTensor (sharded over the mesh)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def expert_load_reader(model: torch.nn.Module):
    """This rank's routed tokens [layers, experts] since the last read (the engine's counters), or None."""
    reader = pop_routed_load if load_counters(model) else None
    if reader is not None:
        reader(model)  # start from zero
    return reader


def router_biases_to_update(model: torch.nn.Module, hf_config, meta: bool = False) -> list:
    """The score-correction biases train.router_bias_update_rate updates, one per engine MoE layer."""
    counters = len(load_counters(model)) if not meta else None  # a meta model has no engine yet
    try:
        if not meta and not counters:
            raise RouterBiasError(
                f"train.router_bias_update_rate needs the engine's expert counts, and this "
                f"{getattr(hf_config, 'model_type', None)!r} model runs without the engine's "
                "experts; set train.router_bias_update_rate to 0"
            )
        return check_router_bias(model, getattr(hf_config, "model_type", None), counters)
    except RouterBiasError as err:
        raise ConfigError(str(err)) from err
