"""Reading chosen tensors from a Transformers safetensors checkpoint; the checkpoint error."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing or mis-shaped tensors."""


def checkpoint_key_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it, from the index or the single file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {path}; "
                              "point to a directory written by save_pretrained")
    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def read_tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Read exactly `keys` (and nothing else) from the checkpoint at `path`."""
    where = checkpoint_key_files(path)
    missing = [k for k in keys if k not in where]
    if missing:
        raise CheckpointError(f"checkpoint {path} is missing tensors {missing[:8]}"
                              f"{'...' if len(missing) > 8 else ''}; point to a complete checkpoint "
                              "written by save_pretrained, or fix config.json")
    by_file: dict[Path, list[str]] = {}
    for k in keys:
        by_file.setdefault(where[k], []).append(k)
    out = {}
    for file, file_keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            for k in file_keys:
                out[k] = f.get_tensor(k)
    return out
