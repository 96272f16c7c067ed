"""Which file of a Transformers safetensors checkpoint holds each tensor; the folder's files stay inside it."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from workbench.errors import CheckpointError
from workbench.folder_files import file_inside

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FIX = "copy the files into the model folder (a folder written by save_pretrained holds them all)"


def _weight_map(path: Path, index: Path) -> dict[str, str]:
    """The index's tensor name -> file name map; CheckpointError naming the index if it is not one."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (ValueError, UnicodeDecodeError, AttributeError) as err:
        raise CheckpointError(f"{path / INDEX_FILE} is not a safetensors index ({err}); {_FIX}") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(f, str) for k, f in weight_map.items()
    ):
        raise CheckpointError(f"{path / INDEX_FILE} has no weight_map of tensor names to files; {_FIX}")
    return weight_map


def _files_named(path: Path) -> tuple[Path | None, dict[str, Path]]:
    """(the single weights file or None, tensor -> file from the index), every file checked to stay in `path`."""
    index = file_inside(path, INDEX_FILE, str(path), _FIX)
    if index.exists():
        weight_map = _weight_map(path, index)
        files = {f: file_inside(path, f, str(path / INDEX_FILE), _FIX) for f in set(weight_map.values())}
        return None, {k: files[f] for k, f in weight_map.items()}
    return file_inside(path, SINGLE_FILE, str(path), _FIX), {}


def check_model_folder(path: Path) -> None:
    """Refuse a model folder whose config, index or weight files lead outside it (nothing else is read).

    Weights need not be there: which files a load needs is its own check.
    """
    path = Path(path)
    file_inside(path, CONFIG_FILE, str(path), _FIX)
    _files_named(path)


def checkpoint_key_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it, from the index or the single file (all inside `path`)."""
    path = Path(path)
    single, where = _files_named(path)
    if single is None:
        return where
    if not single.exists():
        raise CheckpointError(
            f"no {SINGLE_FILE} or {INDEX_FILE} in {path}; point to a directory written by save_pretrained"
        )
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)
