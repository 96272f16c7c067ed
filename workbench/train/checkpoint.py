"""Checkpoints: torch.distributed.checkpoint (DCP) save/resume, atomic, verified, with shape checks.

Layout of one checkpoint, `<run>/checkpoints/step-00000003/`:
    .metadata, __*_*.distcp    model + optimizer state (DCP; each rank writes its own shards)
    trainer_state.json         step, scheduler, data position (identical on every rank)
    rng/rank-00000.pt          each rank's RNG states (tensors and ints: read with weights_only)
    meta.json                  step, world size, model shape, the settings a resume must keep
    manifest.json              every other file's size and hash (workbench.train.manifest)
Every rank writes into `.tmp-step-00000003`; after a barrier rank 0 writes the JSON files and
the manifest last and renames the directory into place. A directory named `step-*` is therefore
always complete, and it is written once; a run killed mid-save leaves only a `.tmp-*` directory,
which loaders ignore and the next resume from that run removes once the run is no longer alive
(workbench.train.checkpoint_owner). Nothing is unpickled beyond allow-lists (workbench.train.safe_load).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from workbench.errors import CheckpointError
from workbench.models.auto import save_pretrained
from workbench.parallel import dist_utils as du
from workbench.train.checkpoint_checks import check_compatible, check_settings, run_settings, verify_checkpoint
from workbench.train.checkpoint_files import (
    LEFTOVER_PREFIXES,
    META_FILE,
    SHAPE_FIELDS,
    STEP_PREFIX,
    TRAINER_STATE_FILE,
    clean_leftovers,
    list_checkpoints,
    model_shape,
    read_meta,
    resolve_checkpoint,
    step_dir_name,
)
from workbench.train.checkpoint_load import load_checkpoint
from workbench.train.checkpoint_state import _model_optim_state, _quiet_dcp, _rng_file, _rng_state
from workbench.train.expert_state import globalize
from workbench.train.lora_base import META_KEY as LORA_BASE_KEY
from workbench.train.manifest import write_manifest
from workbench.train.safe_load import read_dcp_metadata

# The directory names, the state saved, the resume checks and the load live in their own modules; every
# name callers import stays importable from here. save_checkpoint stays here and writes its JSON files
# through this module's _write_json (tests/save_faults.py replaces it to stop a save midway).
__all__ = [
    "LEFTOVER_PREFIXES",
    "META_FILE",
    "SHAPE_FIELDS",
    "STEP_PREFIX",
    "TRAINER_STATE_FILE",
    "CheckpointError",
    "DiskFullError",
    "check_compatible",
    "check_settings",
    "clean_leftovers",
    "export_hf",
    "list_checkpoints",
    "load_checkpoint",
    "model_shape",
    "read_dcp_metadata",
    "read_meta",
    "resolve_checkpoint",
    "run_settings",
    "save_checkpoint",
    "step_dir_name",
    "verify_checkpoint",
]


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
    lora_base: dict[str, Any] | None = None,
) -> Path:
    """Collective: write checkpoint `step` atomically; returns its final directory.

    `settings` are the run settings a resume must keep (run_settings), recorded in meta.json, with
    `lora_base`, the frozen base a LoRA run's adapters train on (workbench.train.lora_base.base_record).
    On a full disk the partial `.tmp-step-*` is removed (so that the run can still record its
    failure) and DiskFullError says how much space is left.
    """
    try:
        return _write_checkpoint(
            checkpoints_dir, step, model, optimizer, scheduler, data_state, hf_config, settings, lora_base
        )
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
    lora_base: dict[str, Any] | None = None,
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
                **({LORA_BASE_KEY: lora_base} if lora_base is not None else {}),
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
