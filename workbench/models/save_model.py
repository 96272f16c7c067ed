"""A model written as Transformers' checkpoint from any mesh, engine or vanilla (a LoRA model: merged, its adapter
beside it): the save behind workbench.save_pretrained and the engine model's own save_pretrained."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist
from torch import nn

from workbench.models.engine_state import engine_state
from workbench.models.export_folder import check_export_folder, write_whole
from workbench.models.full_state import full_state_dict
from workbench.models.lora_export import save_lora_model
from workbench.models.meta_model import meta_model
from workbench.moe.hf_experts import engine_experts_modules


def save_pretrained(model: nn.Module, out_dir, max_shard_size: str = "5GB") -> None:
    """Transformers' own save of the unsharded model from any mesh, engine or vanilla; collective.

    Transformers' save_pretrained writes the family's disk layout (its reverse weight conversion).
    A model the engine did not change and that is not sharded is saved as it is; any other goes
    through full_state_dict into a twin of Transformers' class (the engine and fully_shard
    renamed the live one's, which save_pretrained records), written by rank 0.
    """
    from torch.distributed.tensor import DTensor

    if engine_state(model).lora is not None:  # LoRA: the merged model, its adapter beside it
        return save_lora_model(model, out_dir, max_shard_size)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    check_export_folder(Path(out_dir), "model")  # on every rank, before the gathers
    if not engine_experts_modules(model) and not any(isinstance(p, DTensor) for p in model.parameters()):
        if rank0:
            write_whole(Path(out_dir), "model", lambda d: model.save_pretrained(d, max_shard_size=max_shard_size))
    else:
        state = full_state_dict(model, to_rank0_only=True)
        if rank0:
            twin = meta_model(model.config)
            twin.load_state_dict(state, assign=True, strict=True)  # a missing tensor fails, not saves meta
            twin.tie_weights()
            write_whole(Path(out_dir), "model", lambda d: twin.save_pretrained(d, max_shard_size=max_shard_size))
    if dist.is_initialized():
        dist.barrier()
