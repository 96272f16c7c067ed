"""A checkpoint's manifest: every file's size and BLAKE2b hash, written at save, checked at resume.

A torn or overwritten shard otherwise loads silently (a same-size overwrite ends in NaN steps
later) or fails deep in torch without naming the file. The hashing is split over the ranks:
after the save's barrier rank r hashes every world-th file of the sorted list and rank 0
gathers the entries and writes the manifest; a resume checks it the same way, before anything
is built. Splitting by position rather than "the files this rank wrote" keeps it independent of
DCP's file naming. The manifest protects against damage, not against an attacker, who can
rewrite it too: what stops crafted files is workbench.train.safe_load.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from workbench.errors import CheckpointError
from workbench.folder_files import file_inside
from workbench.train.safe_load import read_json

MANIFEST_FILE = "manifest.json"
HASH = "blake2b"  # faster than sha256 in software; 256-bit digests
_CHUNK = 8 << 20


def file_entry(path: Path) -> dict[str, Any]:
    """{"size", "blake2b"} of one file."""
    h = hashlib.blake2b(digest_size=32)
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, HASH: h.hexdigest()}


def _files(ckpt: Path) -> list[str]:
    return sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file() and p.name != MANIFEST_FILE)


def _gather(items: dict[str, Any]) -> dict[str, Any]:
    """Merge every rank's dict (all ranks get the union)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return items
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, items)
    return {k: v for part in parts for k, v in part.items()}


def _share(names: list[str]) -> list[str]:
    if dist.is_available() and dist.is_initialized():
        return names[dist.get_rank() :: dist.get_world_size()]
    return names


def _inside(ckpt: Path, name: str, named_by: str) -> Path:
    """`ckpt/name`, refused (CheckpointError) if it leads outside the checkpoint, through a link too."""
    try:
        return file_inside(ckpt, name, named_by, "resume from a checkpoint this workbench saved, as it saved it")
    except CheckpointError as err:
        raise CheckpointError(f"cannot resume from {ckpt}: {err}") from None


def write_manifest(ckpt: Path) -> None:
    """Collective, after every file of `ckpt` is written: rank 0 writes manifest.json."""
    ckpt = Path(ckpt)
    names = _files(ckpt)
    entries = _gather({name: file_entry(ckpt / name) for name in _share(names)})
    if not dist.is_initialized() or dist.get_rank() == 0:
        with open(ckpt / MANIFEST_FILE, "w", encoding="utf-8") as f:
            json.dump({"hash": HASH, "files": {n: entries[n] for n in names}}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())


def verify_manifest(ckpt: Path) -> None:
    """Collective: raise CheckpointError naming each file that is missing or differs from the manifest."""
    ckpt = Path(ckpt)
    if not (ckpt / MANIFEST_FILE).is_file():
        raise CheckpointError(
            f"cannot resume from {ckpt}: it has no {MANIFEST_FILE}, so its files cannot be "
            "verified (a checkpoint of an older workbench, or not one of workbench's); "
            "resume from a checkpoint saved by this version"
        )
    manifest = read_json(_inside(ckpt, MANIFEST_FILE, str(ckpt)), ckpt)
    files = manifest.get("files")
    if (
        manifest.get("hash") != HASH
        or not isinstance(files, dict)
        or not all(isinstance(e, dict) and isinstance(e.get("size"), int) for e in files.values())
    ):
        raise CheckpointError(
            f"cannot resume from {ckpt}: {ckpt / MANIFEST_FILE} is not a {HASH} manifest of this workbench"
        )
    # Every file the resume reads is one the manifest names: none may lie outside the checkpoint.
    paths = {name: _inside(ckpt, name, str(ckpt / MANIFEST_FILE)) for name in files}
    problems: dict[str, str] = {}
    for name, entry in files.items():
        path = paths[name]
        if not path.is_file():
            problems[name] = "missing"
        elif path.stat().st_size != entry["size"]:
            problems[name] = f"{path.stat().st_size} bytes, the manifest says {entry['size']} (truncated or replaced)"
    to_hash = sorted(n for n in files if n not in problems)
    hashed = {n: file_entry(paths[n])[HASH] for n in _share(to_hash)}
    for name, digest in _gather(hashed).items():
        if digest != files[name].get(HASH):
            problems[name] = "contents differ from the manifest (same size: overwritten or corrupted)"
    if problems:
        listed = "; ".join(f"{ckpt / n}: {why}" for n, why in sorted(problems.items()))
        raise CheckpointError(
            f"cannot resume from {ckpt}: damaged checkpoint ({listed}); resume from another "
            "checkpoint of the run (another step-* directory beside it)"
        )
