"""The anchor: vanilla Transformers v5, FSDP2 per decoder layer, as a user would write it."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.bench.config import VariantSpec
from workbench.bench.variant import Prepared, adamw
from workbench.train.optim import describe_optimizer

CUDNN_REASON = "torch's cuDNN SDPA backend needs an NVIDIA GPU"


def build_hf_model(hf_config, seed: int, device: torch.device, dtype: torch.dtype,
                   experts_implementation: str = "grouped_mm"):
    """Transformers' model from a seed, built directly on `device` (same seed, same weights)."""
    import transformers

    cfg = copy.deepcopy(hf_config)  # from_config records the implementations on the config
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, experts_implementation=experts_implementation, attn_implementation="sdpa", dtype=dtype)
    return model.to(device)


def save_init_checkpoint(hf_config, seed: int, device: torch.device, dtype: torch.dtype, out_dir: Path) -> None:
    """Rank 0 writes the seeded initial weights with save_pretrained; every rank waits for it."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        model = build_hf_model(hf_config, seed, device, dtype)
        model.save_pretrained(out_dir)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if dist.is_initialized():
        dist.barrier()


def _sdpa_context(backend: str | None):
    if backend is None:
        import contextlib

        return contextlib.nullcontext
    from torch.nn.attention import SDPBackend, sdpa_kernel

    chosen = {"cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    return lambda: sdpa_kernel(chosen)


def build_anchor(spec: VariantSpec, hf_config, seed: int, lr: float, device: torch.device,
                 dtype: torch.dtype) -> Prepared:
    """The anchor variant on this rank: seeded model, plain FSDP2 over all ranks, AdamW."""
    from torch.distributed.fsdp import fully_shard

    model = build_hf_model(hf_config, seed, device, dtype, spec.experts_implementation)
    model.train()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)

    def forward(ids: torch.Tensor):
        out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        aux = out.aux_loss
        return out.loss, out.loss - coef * aux, aux

    optimizer = adamw(model, lr, device)
    setup = {
        "library": "transformers", "experts_implementation": spec.experts_implementation,
        "attention": "sdpa" + (f" ({spec.sdpa_backend} forced)" if spec.sdpa_backend else ""),
        "fsdp": "fully_shard per decoder layer + root, defaults" if world > 1 else "none (one rank)",
        "optimizer": describe_optimizer(optimizer), "activation_checkpointing": False, "dtype": str(dtype),
    }
    return Prepared(model, optimizer, forward, "mean", setup, _sdpa_context(spec.sdpa_backend))
