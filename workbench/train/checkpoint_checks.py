"""Checks before a resume: the files against the manifest, the model's shape, the run settings a resume keeps."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from workbench.config_io import load_yaml
from workbench.config_train import FIXED_ON_RESUME, FIXED_WHY, RESUME_FIELDS
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


def _set_value(value: Any) -> str:
    """`value` as a --set value (YAML, which the CLI and with_overrides read back to `value`)."""
    if isinstance(value, str):
        try:
            same = load_yaml(value) == value
        except yaml.YAMLError:
            same = False
        return value if same else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_set_value(v) for v in value) + "]"
    return json.dumps(value)


def set_flags(values: dict[str, Any]) -> str:
    """`--set key=value` for each of `values`, quoted for a shell where the value needs it."""
    flags = []
    for key, value in values.items():
        item = f"{key}={_set_value(value)}"
        flags.append(f"--set {item}" if re.fullmatch(r"[\w.=/+:@%-]+", item) else f"--set '{item}'")
    return " ".join(flags)


def _lora_switch(ckpt: Path, saved: dict[str, Any], rc: Any) -> str | None:
    """Why a resume that turns LoRA on or off cannot work, and what to do instead; None if it does not."""
    if "lora.rank" not in saved or (saved["lora.rank"] is None) == (rc.lora is None):
        return None
    if rc.lora is None:
        section = {
            "rank": saved["lora.rank"],
            "alpha": saved.get("lora.alpha"),
            "dropout": saved.get("lora.dropout"),
            "targets": saved.get("lora.targets"),
        }
        inline = "{" + ", ".join(f"{k}: {_set_value(v)}" for k, v in section.items()) + "}"
        return (
            f"cannot resume from {ckpt}: it holds LoRA adapters (rank {section['rank']} on "
            f"{_set_value(section['targets'])}) and no base weights, and this run has no lora section (full "
            "fine-tuning): LoRA cannot be turned off on resume. Resume with the checkpoint's lora section "
            f"(--set 'lora={inline}'); to fine-tune every weight from there, add --set train.export_hf=true to "
            "that resume (it writes the merged model to <its run>/hf) and start a new run with --set "
            "model.preset=null --set 'model.path=<its run>/hf'"
        )
    return (
        f"cannot resume from {ckpt}: it holds a full fine-tune (every weight, no adapters), and this run adds "
        "LoRA (its lora section): LoRA cannot be turned on on resume. Resume without it (--set lora=null); to "
        "train adapters on top of it, add --set train.export_hf=true to that resume (it writes the model to "
        "<its run>/hf) and start a new LoRA run with --set model.preset=null --set 'model.path=<its run>/hf'"
    )


def check_settings(ckpt: Path, rc: Any) -> list[str]:
    """Refuse a resume whose schedule/data settings differ from the checkpoint's, unless accepted.

    Settings that shape the checkpoint's tensors (FIXED_ON_RESUME, LoRA on or off) are refused whatever
    train.resume_allow_changes says, each message with a fix that works when followed. Returns the
    accepted differences (train.resume_allow_changes), one line each, for the log.
    """
    saved, ours = read_meta(ckpt).get("settings", {}), run_settings(rc)
    switch = _lora_switch(ckpt, saved, rc)
    if switch is not None:
        raise CheckpointError(switch)
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
            + ". "
            + "; ".join(f"{k}: {FIXED_WHY[k]}" for k in fixed)
            + "; these cannot change on resume: run with "
            + set_flags({k: saved[k] for k in fixed})
            + ", or start a new run (without train.resume_from) with this run's values (train.export_hf writes "
            "the trained model such a run can start from)"
        )
    refused = [k for k in diffs if k not in rc.train.resume_allow_changes]
    if refused:
        names = sorted(set(refused) | set(rc.train.resume_allow_changes))
        raise CheckpointError(
            f"cannot resume from {ckpt}: this run changes settings the checkpoint was saved with: "
            + "; ".join(diffs[k] for k in refused)
            + ". The LR schedule, the optimizer's update and the data position and order depend on them. "
            f"Use the checkpoint's values ({set_flags({k: saved[k] for k in refused})}), or accept "
            f"this run's values with train.resume_allow_changes: [{', '.join(names)}] (CLI: --set "
            f"'train.resume_allow_changes=[{', '.join(names)}]')"
        )
    return list(diffs.values())
