"""Which file of a Transformers safetensors checkpoint holds each tensor."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from workbench.errors import CheckpointError


def checkpoint_key_files(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it, from the index or the single file."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    single = path / "model.safetensors"
    if not single.exists():
        raise CheckpointError(
            f"no model.safetensors or model.safetensors.index.json in {path}; "
            "point to a directory written by save_pretrained"
        )
    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)
