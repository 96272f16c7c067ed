"""The frozen base a LoRA run's adapters are trained on: recorded in each checkpoint, checked on resume.

A LoRA checkpoint holds the adapters only; a resume rebuilds the base from its own model settings, so
adapters resumed on another base (another model.path with the same shapes, a preset instead of the
path, another seed) would train on against weights they were not made for. meta.json therefore
records the base:
- a preset: its name, model.layers and train.seed. A seeded build gives the same weights on any
  mesh, device and world size (workbench.models.random_init), so the description is exact.
- model.path: the folder, model.layers and a BLAKE2b digest of its safetensors weight files.
  The files rather than the loaded parameters: their bytes do not depend on the mesh (a parameter
  digest would need every shard gathered in one order), the dtype the run casts to, or the device,
  so a resume on another mesh or GPU still matches; and they are hashed before the model is built,
  so another base is refused before any weight is read into memory. The hashing is split over the
  ranks like the checkpoint manifest (rank r hashes every world-th file), and each rank hashes its
  files in threads (hashlib releases the GIL on large buffers): about a second per GB on one rank.
A moved folder with the same files is the same base (the digest decides, not the path).
"""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from workbench.errors import CheckpointError
from workbench.models.hf_io import checkpoint_key_files
from workbench.parallel import dist_utils as du
from workbench.train.checkpoint_checks import set_flags
from workbench.train.manifest import HASH, file_entry

META_KEY = "lora_base"  # meta.json's field
_DIGEST = f"weights_{HASH}"
_HASH_THREADS = 4


def describe_base(rc: Any) -> dict[str, Any] | None:
    """What builds the run's frozen base (no file read), or None for a run without LoRA."""
    if rc.lora is None:
        return None
    if rc.model.path is not None:
        return {"path": str(Path(rc.model.path).expanduser().resolve()), "layers": rc.model.layers}
    return {"preset": rc.model.preset, "layers": rc.model.layers, "seed": rc.train.seed}


def weights_digest(path: Path) -> str:
    """Collective: one BLAKE2b digest over the safetensors files holding a model folder's tensors."""
    path = Path(path)
    names = sorted({f.relative_to(path).as_posix() for f in checkpoint_key_files(path).values()})
    mine = names[du.rank() :: du.world_size()]
    with ThreadPoolExecutor(max_workers=max(1, min(_HASH_THREADS, len(mine)))) as pool:
        entries = du.gather_dicts(dict(zip(mine, pool.map(lambda n: file_entry(path / n), mine))))
    listing = json.dumps([[n, entries[n]["size"], entries[n][HASH]] for n in names])
    return hashlib.blake2b(listing.encode(), digest_size=32).hexdigest()


def base_record(description: dict[str, Any] | None) -> dict[str, Any] | None:
    """Collective: `description` plus, for a model.path base, the digest of its weight files."""
    if description is None or "path" not in description:
        return description
    return {**description, _DIGEST: weights_digest(Path(description["path"]))}


def saved_base(ckpt: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The base record in a checkpoint's meta.json (None: full fine-tuning, or saved before bases were recorded)."""
    saved = meta.get(META_KEY)
    if saved is None:
        return None
    if (
        not isinstance(saved, dict)
        or ("preset" in saved) == ("path" in saved)
        or not all(isinstance(saved.get(k), str) for k in ("preset", "path", _DIGEST) if k in saved)
    ):
        raise CheckpointError(f"cannot resume from {ckpt}: its meta.json has a {META_KEY} that is not a base record")
    return saved


def _overrides(saved: dict[str, Any], ours: dict[str, Any]) -> str:
    """The --set overrides that make this run build the saved base."""
    values: dict[str, Any] = {}
    if "preset" in saved:
        if ours.get("preset") != saved["preset"]:
            values["model.preset"] = saved["preset"]
        if "path" in ours:
            values["model.path"] = None
        if ours.get("seed") != saved.get("seed"):
            values["train.seed"] = saved.get("seed")
    else:
        values["model.path"] = saved["path"]
        if "preset" in ours:
            values["model.preset"] = None
    if ours.get("layers") != saved.get("layers"):
        values["model.layers"] = saved.get("layers")
    return set_flags(values)


def _name(base: dict[str, Any]) -> str:
    layers = f", model.layers {base['layers']}" if base.get("layers") is not None else ""
    if "preset" in base:
        return f"preset {base['preset']!r} built with train.seed {base.get('seed')}{layers}"
    return f"model.path {base['path']}{layers}"


def check_base_description(ckpt: Path, saved: dict[str, Any] | None, ours: dict[str, Any] | None) -> None:
    """Before anything is built: refuse a LoRA resume whose base is described otherwise than the checkpoint's.

    `saved`: the checkpoint's record (None: not a LoRA checkpoint, or one saved before bases were recorded).
    Two model.path bases are compared by their weights (check_base_weights), not here.
    """
    if saved is None or ours is None:
        return
    described = {k: v for k, v in saved.items() if k != _DIGEST}
    if "path" in described and "path" in ours:
        described["path"] = ours["path"]  # a moved folder may hold the same base: the weights decide
    if described == ours:
        return
    raise CheckpointError(
        f"cannot resume from {ckpt}: its LoRA adapters were trained on {_name(saved)}, and this run builds its "
        f"base from {_name(ours)}; adapters only fit the base they were trained on. Resume on that base "
        f"({_overrides(saved, ours)}), or train new adapters on this base in a new run (without "
        "train.resume_from)"
    )


def check_base_weights(ckpt: Path, saved: dict[str, Any] | None, ours: dict[str, Any] | None) -> None:
    """Refuse a LoRA resume whose model.path holds other weight files than the checkpoint's base (before the build)."""
    if saved is None or ours is None or _DIGEST not in saved or _DIGEST not in ours:
        return
    if saved[_DIGEST] == ours[_DIGEST]:
        return
    short_saved, short_ours = saved[_DIGEST][:16], ours[_DIGEST][:16]
    if saved["path"] == ours["path"]:
        fix = (
            f"the weight files in {ours['path']} changed since (blake2b {short_saved}... then, {short_ours}... now). "
            "Put the base they were trained on back in that folder and resume, or train new adapters on this "
            "base in a new run (without train.resume_from)"
        )
    else:
        fix = (
            f"this run's model.path {ours['path']} holds other weights (blake2b {short_ours}... against "
            f"{short_saved}...). Resume on that base ({_overrides(saved, ours)}), or train new adapters on this "
            "base in a new run (without train.resume_from)"
        )
    raise CheckpointError(
        f"cannot resume from {ckpt}: its LoRA adapters were trained on the base weights of {saved['path']}, and " + fix
    )
