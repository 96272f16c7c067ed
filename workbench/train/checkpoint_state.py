"""What a checkpoint holds per rank besides its files' names: RNG states and the DCP model/optimizer state."""

from __future__ import annotations

import contextlib
import random
import warnings
from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError
from workbench.models.engine_state import engine_state
from workbench.parallel import dist_utils as du
from workbench.train.checkpoint_files import read_meta
from workbench.train.safe_load import load_tensors


def _rng_state() -> dict[str, Any]:
    # Tensors, ints and tuples only: the file loads with torch.load(weights_only=True).
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _rng_file(ckpt: Path) -> Path:
    return ckpt / "rng" / f"rank-{du.rank():05d}.pt"


def _read_rng(ckpt: Path) -> dict[str, Any] | None:
    """This rank's RNG states, if the checkpoint was saved with this world size."""
    path = _rng_file(ckpt)
    if not path.is_file() or read_meta(ckpt).get("world_size") != du.world_size():
        return None
    state = load_tensors(path, ckpt)
    python = state.get("python") if isinstance(state, dict) else None
    if (
        not isinstance(python, (tuple, list))
        or len(python) != 3
        or not isinstance(python[1], (tuple, list))
        or not isinstance(state.get("torch"), torch.Tensor)
    ):
        raise CheckpointError(f"cannot resume from {ckpt}: {path} does not hold RNG states")
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


@contextlib.contextmanager
def _quiet_dcp():
    """DCP warns when used without a process group; a one-process run is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state_options(model: torch.nn.Module):
    """LoRA: only the trainable tensors (adapters) and their optimizer state; the frozen base is rebuilt."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if engine_state(model).lora is None:
        return None
    # The frozen base comes back from the run's model source (preset + seed, or model.path) on resume;
    # strict=False lets load_state_dict skip exactly those frozen keys (dcp.load already fails on a
    # missing adapter).
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _model_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options(model))
    return {"model": model_sd, "optim": optim_sd}
