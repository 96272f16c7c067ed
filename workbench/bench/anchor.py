"""The anchor: vanilla Transformers v5 (FSDP2 per decoder layer on several ranks), trained by the Trainer."""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

from workbench.bench.config import VariantSpec
from workbench.bench.liger import liger_patched
from workbench.models.mesh_build import shard_without_engine
from workbench.parallel import dist_utils as du
from workbench.parallel.mesh import MeshConfig

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
    return (
        f"Transformers' {model_class.__name__} refuses attn_implementation={attn_implementation!r}{sinks}: "
        f"{flag} is False; see the other anchor rows"
    )


def build_hf_model(
    hf_config,
    seed: int,
    device: torch.device,
    dtype: torch.dtype,
    experts_implementation: str = "grouped_mm",
    attn_implementation: str = "sdpa",
):
    """Transformers' model from a seed, built directly on `device` (same seed, same weights)."""
    import transformers

    cfg = copy.deepcopy(hf_config)  # from_config records the implementations on the config
    torch.manual_seed(seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, experts_implementation=experts_implementation, attn_implementation=attn_implementation, dtype=dtype
        )
    return model.to(device)


def save_init_checkpoint(hf_config, seed: int, device: torch.device, dtype: torch.dtype, out_dir: Path) -> None:
    """Rank 0 writes the seeded initial weights with save_pretrained; every rank waits for it."""
    if du.rank() == 0:
        model = build_hf_model(hf_config, seed, device, dtype, attn_implementation=CHECKPOINT_ATTENTION)
        model.save_pretrained(out_dir)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    du.barrier()


def _sdpa_context(backend: str | None) -> contextlib.AbstractContextManager:
    if backend is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION}[backend])


def build_anchor(
    spec: VariantSpec, hf_config, seed: int, device: torch.device, dtype: torch.dtype, stack: contextlib.ExitStack
) -> tuple[torch.nn.Module, dict]:
    """The anchor on this rank, ready for Trainer.setup(model=...): seeded model, FSDP2 per decoder layer.

    `stack` holds what must stay on while it trains (Liger's patch of Transformers, a forced SDPA
    backend). More than one rank: workbench's FSDP2 wrap of a Transformers model (per decoder layer
    + root, gradients summed, as the Trainer's loss normalization needs: the plain fully_shard
    default averages them); a user's Trainer run of a vanilla Transformers model gets the same.
    """
    model = build_hf_model(hf_config, seed, device, dtype, spec.experts_implementation, spec.attn_implementation)
    setup: dict = {
        "library": "transformers",
        "experts_implementation": spec.experts_implementation,
        "attention": spec.attn_implementation + (f" ({spec.sdpa_backend} forced)" if spec.sdpa_backend else ""),
        "dtype": str(dtype),
    }
    if spec.liger:
        setup.update(stack.enter_context(liger_patched(model)))  # before sharding: it patches modules in place
    world = du.world_size()
    if world > 1:
        model = shard_without_engine(model, MeshConfig(dp=world, ep=1))
    setup["fsdp"] = "fully_shard per decoder layer + root, summed grads" if world > 1 else "none (one rank)"
    stack.enter_context(_sdpa_context(spec.sdpa_backend))
    return model, setup
