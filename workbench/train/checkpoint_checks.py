"""Checks before a resume: the files against the manifest, the model's shape, the run settings a resume keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.config import FIXED_ON_RESUME, RESUME_FIELDS
from workbench.errors import CheckpointError
from workbench.train.checkpoint_files import SHAPE_FIELDS, TRAINER_STATE_FILE, model_shape, read_meta
from workbench.train.checkpoint_state import _read_rng
from workbench.train.manifest import MANIFEST_FILE, verify_manifest
from workbench.train.safe_load import check_dcp_values, read_dcp_metadata, read_json


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
    fixed = [k for k in diffs if k in FIXED_ON_RESUME]
    if fixed:
        raise CheckpointError(
            f"cannot resume from {ckpt}: "
            + "; ".join(diffs[k] for k in fixed)
            + ". The checkpoint's optimizer state is laid out by these, so they cannot change on resume: run with "
            + " ".join(f"--set {k}={saved[k]}" for k in fixed)
            + ", or start a new run from the exported model (train.export_hf)"
        )
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
