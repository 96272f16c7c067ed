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
# Flags of Transformers' PreTrainedModel saying whether a family runs an attention implementation.
_SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flex_attention": "_supports_flex_attn"}
# The attention the shared initial checkpoint is built with: every family runs it, and the weights
# do not depend on the attention implementation.
CHECKPOINT_ATTENTION = "eager"


def attention_refusal(hf_config, attn_implementation: str) -> str | None:
    """Why Transformers' class for `hf_config` refuses `attn_implementation`; None when it runs it.

    Read from the class's own support flags, so the refusal is recorded before a large model is
    built (GPT-OSS sets _supports_sdpa = False: torch SDPA has no attention sinks).
    """
    import transformers

    flag = _SUPPORT_FLAGS.get(attn_implementation)
    if flag is None:
        return None
    try:
        model_class = transformers.AutoModelForCausalLM._model_mapping[type(hf_config)]
    except KeyError:
        return None  # not a causal LM Transformers maps: its build reports what is wrong
    if getattr(model_class, flag, True):
        return None
    sinks = " (attention sinks)" if getattr(hf_config, "model_type", "") == "gpt_oss" else ""
    return (f"Transformers' {model_class.__name__} refuses attn_implementation={attn_implementation!r}{sinks}: "
            f"{flag} is False; see the other anchor rows")


def build_hf_model(hf_config, seed: int, device: torch.device, dtype: torch.dtype,
                   experts_implementation: str = "grouped_mm", attn_implementation: str = "sdpa"):
    """Transformers' model from a seed, built directly on `device` (same seed, same weights)."""
    import transformers

    cfg = copy.deepcopy(hf_config)  # from_config records the implementations on the config
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, experts_implementation=experts_implementation, attn_implementation=attn_implementation, dtype=dtype)
    return model.to(device)


def save_init_checkpoint(hf_config, seed: int, device: torch.device, dtype: torch.dtype, out_dir: Path) -> None:
    """Rank 0 writes the seeded initial weights with save_pretrained; every rank waits for it."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        model = build_hf_model(hf_config, seed, device, dtype, attn_implementation=CHECKPOINT_ATTENTION)
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


def family_losses(out, coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, aux) of a Transformers output whose loss is CE + coef * aux.

    Families without an aux loss (DeepSeek-V3: its routing is balanced by a bias) give aux 0.
    """
    aux = getattr(out, "aux_loss", None)
    if aux is None:
        return out.loss, out.loss.new_zeros(())
    aux = aux.to(out.loss.device)
    return out.loss - coef * aux, aux


def build_anchor(spec: VariantSpec, hf_config, seed: int, lr: float, device: torch.device,
                 dtype: torch.dtype) -> Prepared:
    """The anchor variant on this rank: seeded model, plain FSDP2 over all ranks, AdamW."""
    from torch.distributed.fsdp import fully_shard

    model = build_hf_model(hf_config, seed, device, dtype, spec.experts_implementation, spec.attn_implementation)
    model.train()
    world = dist.get_world_size() if dist.is_initialized() else 1
    if world > 1:
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)

    def forward(ids: torch.Tensor):
        out = model(input_ids=ids, labels=ids, output_router_logits=True, use_cache=False)
        ce, aux = family_losses(out, coef)
        return out.loss, ce, aux

    optimizer = adamw(model, lr, device)
    setup = {
        "library": "transformers", "experts_implementation": spec.experts_implementation,
        "attention": spec.attn_implementation + (f" ({spec.sdpa_backend} forced)" if spec.sdpa_backend else ""),
        "fsdp": "fully_shard per decoder layer + root, defaults" if world > 1 else "none (one rank)",
        "optimizer": describe_optimizer(optimizer), "activation_checkpointing": False, "dtype": str(dtype),
    }
    return Prepared(model, optimizer, forward, "mean", setup, _sdpa_context(spec.sdpa_backend))
