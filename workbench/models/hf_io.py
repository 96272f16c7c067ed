"""Reading only this rank's tensors from a Transformers checkpoint, and writing one from any mesh."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor


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


def assemble_tensor(adapter, name: str, tensors: dict[str, torch.Tensor], expert_range: tuple[int, int]
                    ) -> torch.Tensor:
    """One in-memory tensor from its on-disk pieces."""
    return adapter.assemble_from_disk(name, tensors, expert_range)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered_disk_state(model, adapter, expert_range: tuple[int, int], owns_experts: bool) -> dict:
    """Every tensor of the model in Transformers' on-disk layout, gathered onto rank 0.

    Dense tensors come from rank 0; each expert's tensors from the one rank of its ep group
    that has expert-data-parallel index 0, so nothing is sent twice.
    """
    rank = dist.get_rank() if dist.is_initialized() else 0
    local: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        full = _local(tensor).detach()  # collective for DTensors: every rank runs it in the same order
        is_expert = adapter.FUSED_KEY.match(name) is not None
        if (is_expert and owns_experts) or (not is_expert and rank == 0):
            for k, v in adapter.fused_to_disk(name, full, expert_range[0]).items():
                local[k] = v.to("cpu").contiguous()
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    parts = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(local, parts, dst=0)
    if rank != 0:
        return {}
    merged: dict[str, torch.Tensor] = {}
    for part in parts:
        merged.update(part)
    return merged


def write_hf_checkpoint(state: dict[str, torch.Tensor], config, out_dir: Path, max_shard_size: str = "5GB") -> None:
    """Write sharded safetensors + config atomically: a temp dir beside `out_dir`, then a rename."""
    from huggingface_hub import split_torch_state_dict_into_shards

    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
        for filename, names in split.filename_to_tensors.items():
            save_file({n: state[n] for n in names}, tmp / filename, metadata={"format": "pt"})
        if split.is_sharded:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
                     "weight_map": split.tensor_to_filename}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
        config.save_pretrained(tmp)
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
            os.replace(tmp, out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
