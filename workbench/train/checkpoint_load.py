"""Loading a checkpoint into a built model: tensor shape check, DCP load, optimizer, schedule and RNG restore."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError
from workbench.train.checkpoint_files import TRAINER_STATE_FILE
from workbench.train.checkpoint_state import _model_optim_state, _quiet_dcp, _read_rng, _set_rng_state, _state_options
from workbench.train.expert_state import globalize
from workbench.train.safe_load import read_dcp_metadata, read_json, safe_dcp_reader_and_planner


def _check_tensor_shapes(ckpt: Path, state: dict[str, Any]) -> None:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = read_dcp_metadata(ckpt).state_dict_metadata
    problems = []
    for key, value in state["model"].items():
        full_key = f"model.{key}"
        if not isinstance(value, torch.Tensor):
            continue
        md = saved.get(full_key)
        if md is None:
            problems.append(f"{key} missing")
        elif isinstance(md, TensorStorageMetadata) and tuple(md.size) != tuple(value.shape):
            problems.append(f"{key} {tuple(md.size)} vs {tuple(value.shape)}")
    if problems:
        shown = "; ".join(problems[:5]) + (f"; ... ({len(problems)} in all)" if len(problems) > 5 else "")
        raise CheckpointError(f"cannot resume from {ckpt}: its tensors do not fit this model ({shown})")


_OPTIMIZER_HYPER = ("weight_decay", "betas", "eps")


def _restore_schedule(scheduler: Any, optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> None:
    """Continue at the saved step on THIS run's schedule (its lr lambda and peak lr)."""
    base_lrs = list(scheduler.base_lrs)  # this run's peak lr; the optimizer state brought the old one
    counters = {k: v for k, v in saved.items() if k in scheduler.state_dict() and k not in ("base_lrs", "lr_lambdas")}
    state = {**counters, "lr_lambdas": [None] * len(scheduler.lr_lambdas), "base_lrs": base_lrs}
    scheduler.load_state_dict(state)
    for group, base, fn in zip(optimizer.param_groups, base_lrs, scheduler.lr_lambdas):
        group["initial_lr"] = base
        group["lr"] = base * fn(scheduler.last_epoch)  # what LambdaLR.get_lr computes
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def load_checkpoint(
    ckpt: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any
) -> dict[str, Any]:
    """Collective: restore model, optimizer, scheduler and RNG; returns {"step", "data"}."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    ckpt = Path(ckpt)
    state = _model_optim_state(model, optimizer)
    view = globalize(model, state)  # shares storage with `state`: loading into it fills `state`
    _check_tensor_shapes(ckpt, view)
    reader, planner = safe_dcp_reader_and_planner(ckpt)
    with _quiet_dcp():
        dcp.load(view, checkpoint_id=str(ckpt), storage_reader=reader, planner=planner)
    # The optimizer state brings the saved hyper-parameters back; this run's are the ones
    # check_settings let through (equal, or accepted in train.resume_allow_changes).
    hyper = [{k: group[k] for k in _OPTIMIZER_HYPER if k in group} for group in optimizer.param_groups]
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_state_options(model),
    )
    for group, ours in zip(optimizer.param_groups, hyper):
        group.update(ours)
    trainer_state = read_json(ckpt / TRAINER_STATE_FILE, ckpt)
    _restore_schedule(scheduler, optimizer, trainer_state["scheduler"])
    rng = _read_rng(ckpt)
    if rng is not None:
        _set_rng_state(rng)
    return {"step": trainer_state["step"], "data": trainer_state["data"]}


def load_model_weights(ckpt: str | Path, model: torch.nn.Module) -> int:
    """The model tensors of checkpoint `ckpt` into `model`, built on one process without a mesh; returns its step.

    Reading the weights only (`workbench generate`): no optimizer is built and the schedule and RNG
    are left alone. A LoRA model reads its adapters (the checkpoint holds no frozen base tensor).
    The files go through the same allow-lists as a resume (workbench.train.safe_load).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    ckpt = Path(ckpt)
    options = _state_options(model)
    state = {"model": get_model_state_dict(model, options=options)}
    _check_tensor_shapes(ckpt, state)
    reader, planner = safe_dcp_reader_and_planner(ckpt)
    with _quiet_dcp():
        dcp.load(state, checkpoint_id=str(ckpt), storage_reader=reader, planner=planner)
    set_model_state_dict(model, state["model"], options=options)
    return int(read_json(ckpt / TRAINER_STATE_FILE, ckpt)["step"])
