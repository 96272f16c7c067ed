"""Checkpoints: torch.distributed.checkpoint (DCP) save/resume, atomic, verified, with shape checks.

Layout of one checkpoint, `<run>/checkpoints/step-00000003/`:
    .metadata, __*_*.distcp    model + optimizer state (DCP; each rank writes its own shards)
    trainer_state.json         step, scheduler, data position (identical on every rank)
    rng/rank-00000.pt          each rank's RNG states (tensors and ints: read with weights_only)
    meta.json                  step, world size, model shape, the settings a resume must keep
    manifest.json              every other file's size and hash (workbench.train.manifest)
Every rank writes into `.tmp-step-00000003`; after a barrier rank 0 writes the JSON files and
the manifest last and renames the directory into place. A directory named `step-*` is therefore
always complete; a run killed mid-save leaves only a `.tmp-*` directory, which loaders ignore
and the next resume from that run removes. Nothing is unpickled beyond allow-lists
(workbench.train.safe_load).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from workbench.config import RESUME_FIELDS
from workbench.errors import CheckpointError
from workbench.models.auto import save_pretrained
from workbench.parallel import dist_utils as du
from workbench.train.expert_state import globalize
from workbench.train.manifest import MANIFEST_FILE, verify_manifest, write_manifest
from workbench.train.safe_load import (
    check_dcp_values,
    load_tensors,
    read_dcp_metadata,
    read_json,
    safe_dcp_reader_and_planner,
)

META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.json"
STEP_PREFIX = "step-"
LEFTOVER_PREFIXES = (".tmp-step-", ".old-step-")  # saves that never finished (see save_checkpoint)
SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_experts_per_tok",
    "tie_word_embeddings",
)


def model_shape(hf_config: Any) -> dict[str, Any]:
    """The config fields that decide tensor shapes."""
    return {k: getattr(hf_config, k, None) for k in SHAPE_FIELDS}


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:08d}"


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

    if getattr(model, "workbench_lora", None) is None:
        return None
    # The frozen base comes back from the run's model source (preset + seed, or model.path) on resume;
    # strict=False lets load_state_dict skip exactly those frozen keys (dcp.load already fails on a
    # missing adapter).
    return StateDictOptions(ignore_frozen_params=True, strict=False)


def _model_optim_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options(model))
    return {"model": model_sd, "optim": optim_sd}


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


class DiskFullError(OSError):
    """No space left while saving a checkpoint; the partial save was removed."""


def _disk_full(err: BaseException) -> bool:
    # DCP reports a failed write as a CheckpointException (a BaseException) holding each rank's error.
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        return any(isinstance(f, tuple) and f and _disk_full(f[0]) for f in failures.values())
    cause = err.__cause__ or err.__context__
    return cause is not None and _disk_full(cause)


def save_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data_state: dict,
    hf_config: Any,
    settings: dict[str, Any] | None = None,
) -> Path:
    """Collective: write checkpoint `step` atomically; returns its final directory.

    `settings` are the run settings a resume must keep (run_settings), recorded in meta.json.
    On a full disk the partial `.tmp-step-*` is removed (so that the run can still record its
    failure) and DiskFullError says how much space is left.
    """
    try:
        return _write_checkpoint(checkpoints_dir, step, model, optimizer, scheduler, data_state, hf_config, settings)
    except BaseException as err:
        if not _disk_full(err):
            raise
        root = Path(checkpoints_dir)
        shutil.rmtree(root / f".tmp-{step_dir_name(step)}", ignore_errors=True)
        try:
            free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free"
        except OSError:
            free = "free space unknown"
        raise DiskFullError(
            errno.ENOSPC,
            f"disk full while saving step {step}: {free} on {root}; "
            "free space or set output_dir to a larger disk, then resume",
        ) from err


def _write_checkpoint(
    checkpoints_dir: str | Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    data_state: dict,
    hf_config: Any,
    settings: dict[str, Any] | None,
) -> Path:
    import torch.distributed.checkpoint as dcp

    root = Path(checkpoints_dir)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}"
    if du.rank() == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a run killed while saving
        tmp.mkdir()
        (tmp / "rng").mkdir()
    du.barrier()
    with _quiet_dcp():
        dcp.save(globalize(model, _model_optim_state(model, optimizer)), checkpoint_id=str(tmp))
    torch.save(_rng_state(), _rng_file(tmp))
    du.barrier()
    if du.rank() == 0:
        _write_json(
            tmp / TRAINER_STATE_FILE, {"step": step, "scheduler": scheduler.state_dict(), "data": dict(data_state)}
        )
        _write_json(
            tmp / META_FILE,
            {
                "step": step,
                "world_size": du.world_size(),
                "model": model_shape(hf_config),
                "settings": dict(settings or {}),
            },
        )
    du.barrier()
    write_manifest(tmp)
    if du.rank() == 0:
        if final.exists():  # re-saving the same step: move the old one aside, then swap
            old = root / f".old-{step_dir_name(step)}"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    du.barrier()
    return final


def list_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete checkpoints under a checkpoints directory, oldest first."""
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX) and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from a step dir, a checkpoints dir or a run dir (latest wins)."""
    path = Path(path).expanduser()
    if path.name.startswith(LEFTOVER_PREFIXES):
        raise CheckpointError(
            f"{path} is a save that never finished (a run stopped while writing it); "
            f"pass the run directory or one of its {STEP_PREFIX}* checkpoints"
        )
    if (path / META_FILE).is_file():
        return path
    for root in (path, path / "checkpoints"):
        found = list_checkpoints(root)
        if found:
            return found[-1]
    raise CheckpointError(
        f"no complete checkpoint at {path} (looked for {META_FILE} in it, in step-* "
        "subdirectories and under checkpoints/); pass a run or checkpoint directory"
    )


def read_meta(ckpt: Path) -> dict[str, Any]:
    """meta.json of a checkpoint; CheckpointError naming the file if it is not JSON."""
    return read_json(Path(ckpt) / META_FILE, Path(ckpt))


def verify_checkpoint(ckpt: Path) -> dict[str, Any]:
    """Collective, before anything is built: check every file against the manifest, read the small ones.

    Raises CheckpointError naming the file that is damaged, missing or crafted; returns meta.json.
    """
    verify_manifest(ckpt)
    meta = read_meta(ckpt)
    state = read_json(ckpt / TRAINER_STATE_FILE, ckpt)
    if not (
        isinstance(state.get("step"), int)
        and isinstance(state.get("scheduler"), dict)
        and isinstance(state.get("data"), dict)
    ):
        raise CheckpointError(f"cannot resume from {ckpt}: {ckpt / TRAINER_STATE_FILE} lacks step, scheduler or data")
    check_dcp_values(ckpt, read_dcp_metadata(ckpt), set(read_json(ckpt / MANIFEST_FILE, ckpt)["files"]))
    _read_rng(ckpt)
    return meta


def check_compatible(ckpt: Path, hf_config: Any) -> dict[str, Any]:
    """Raise CheckpointError if `ckpt` was written for a model of another shape."""
    meta = read_meta(ckpt)
    saved, ours = meta.get("model", {}), model_shape(hf_config)
    diffs = [
        f"{k}: checkpoint {saved.get(k)!r} vs this run {ours[k]!r}"
        for k in SHAPE_FIELDS
        if k in saved and saved.get(k) != ours[k]
    ]
    if diffs:
        raise CheckpointError(
            f"cannot resume from {ckpt}: it holds a model of another shape ("
            + "; ".join(diffs)
            + "); use a checkpoint of this model or change the model config"
        )
    return meta


def run_settings(rc: Any) -> dict[str, Any]:
    """The run's values of RESUME_FIELDS (what the LR schedule and the data position depend on)."""
    out = {}
    for name in RESUME_FIELDS:
        section, field = name.split(".")
        value = getattr(getattr(rc, section), field, None)  # lora: None when the run has no LoRA section
        out[name] = list(value) if isinstance(value, tuple) else value
    return out


def check_settings(ckpt: Path, rc: Any) -> list[str]:
    """Refuse a resume whose schedule/data settings differ from the checkpoint's, unless accepted.

    Returns the accepted differences (train.resume_allow_changes), one line each, for the log.
    """
    saved, ours = read_meta(ckpt).get("settings", {}), run_settings(rc)
    diffs = {
        k: f"{k}: checkpoint {saved[k]!r} vs this run {ours[k]!r}"
        for k in RESUME_FIELDS
        if k in saved and saved[k] != ours[k]
    }
    refused = [k for k in diffs if k not in rc.train.resume_allow_changes]
    if refused:
        names = sorted(set(refused) | set(rc.train.resume_allow_changes))
        raise CheckpointError(
            f"cannot resume from {ckpt}: this run changes settings the checkpoint was saved with: "
            + "; ".join(diffs[k] for k in refused)
            + ". The LR schedule, the optimizer's update and the data position depend on them. "
            "Use the checkpoint's values, or accept "
            f"this run's values with train.resume_allow_changes: [{', '.join(names)}] (CLI: --set "
            f"'train.resume_allow_changes=[{', '.join(names)}]')"
        )
    return list(diffs.values())


def clean_leftovers(ckpt: Path) -> list[Path]:
    """Rank 0: remove unfinished saves (`.tmp-step-*`, `.old-step-*`) next to checkpoint `ckpt`."""
    if du.rank() != 0 or not ckpt.name.startswith(STEP_PREFIX):
        return []
    removed = [p for p in ckpt.parent.iterdir() if p.is_dir() and p.name.startswith(LEFTOVER_PREFIXES)]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


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


def export_hf(model: torch.nn.Module, out_dir: str | Path) -> Path:
    """Collective: write a vanilla Transformers checkpoint atomically (gathers EP/FSDP shards)."""
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(f".tmp-{out_dir.name}")
    if du.rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    du.barrier()
    save_pretrained(model, str(tmp))
    du.barrier()
    if du.rank() == 0:
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    du.barrier()
    return out_dir
