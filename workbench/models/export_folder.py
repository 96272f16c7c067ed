"""Export folders: one kind each (a model or a top-level adapter), written whole or not at all.

A folder holding both a model (config.json and weights) and an adapter_config.json at its top is
read by Transformers' from_pretrained as the model with the adapter applied on top: a merged
model then gets its LoRA update twice, silently. Each save therefore refuses a folder that holds
the other kind. A save writes into a new folder beside the target and moves its files in only once
every file is written, so a full disk leaves no config.json without its weights; a save killed before that
leaves its `.tmp-<name>-<pid>` folder, which the next save to the same folder removes.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from workbench.dead_builds import remove_dead_builds, temp_folder

MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
KINDS = {"model": MODEL_FILES, "adapter": ADAPTER_FILES}
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def check_export_folder(out_dir: Path, kind: str) -> None:
    """Refuse `out_dir` for a `kind` ("model" or "adapter") save: a file there, or the other kind at its top."""
    out_dir = Path(out_dir)
    for folder in (out_dir, *out_dir.parents):
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(
                    f"cannot save the {kind} to {out_dir}: {folder} is a file, not a folder; pass a folder "
                    "path (it is created if missing)"
                )
            break
    other = "adapter" if kind == "model" else "model"
    found = [name for name in KINDS[other] if (out_dir / name).exists()]
    if found:
        hint = " (e.g. its adapter/ subfolder)" if kind == "adapter" else ""
        raise ValueError(
            f"cannot save the {kind} to {out_dir}: it already holds a {other} ({', '.join(found)}), and "
            f"from_pretrained on a folder with both loads the model with the adapter applied on top; "
            f"save the {kind} to another folder{hint}"
        )


def _stale(out_dir: Path, written: set[str]) -> list[Path]:
    """A previous save's weight files the new one did not write (another shard count)."""
    return [
        p
        for p in out_dir.glob("model*.safetensors*")
        if p.name not in written and (p.name.endswith(".safetensors") or p.name == MODEL_FILES[2])
    ]


def write_whole(out_dir: Path, kind: str, write: Callable[[Path], None]) -> Path:
    """`write(folder)` into a new folder beside `out_dir`, then its files moved into `out_dir`.

    On any failure the new folder is removed and `out_dir` is as it was; a full disk is said so,
    naming the folder. Files of `out_dir` the save does not write stay (a tokenizer beside the model).
    """
    out_dir = Path(out_dir)
    check_export_folder(out_dir, kind)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_builds(out_dir)  # a save killed before its rename left its folder beside this one
    tmp = temp_folder(out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except BaseException as err:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(err, OSError) and err.errno in _DISK_FULL:
            raise OSError(
                err.errno,
                f"the disk is full: cannot save the {kind} to {out_dir} ({err}); nothing was written "
                "there: free space on that disk, or save to a folder on another disk",
            ) from err
        raise
    if not out_dir.exists():
        os.replace(tmp, out_dir)
        return out_dir
    written = {p.name for p in tmp.iterdir()}
    for old in _stale(out_dir, written):
        old.unlink()
    for name in sorted(written):  # renames within one disk: no space needed, each one atomic
        os.replace(tmp / name, out_dir / name)
    tmp.rmdir()
    return out_dir
