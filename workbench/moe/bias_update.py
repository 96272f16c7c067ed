"""The aux-loss-free load balancing of DeepSeek-V3: after each optimizer step, nudge the routing bias.

Families whose router adds a score-correction bias to the scores it picks the top-k by (and not to
the weights it returns) hold it as `e_score_correction_bias` (Transformers 5.17 and 5.24:
deepseek_v3, glm4_moe, minimax_m2, dots1, ernie4_5_moe and more: a float32 buffer, or for
ernie4_5_moe a frozen parameter `[1, E]`). The update, per MoE layer, is

    bias_e += rate * sign(mean_e(load) - load_e)

with `load` the (token, slot) pairs routed to each expert over the whole global batch: every rank
counts its own tokens over all E experts (workbench.moe.routed_load) and the counts are summed over
the world, so every rank applies the same update to its replica of the bias.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# Shape suffixes: L MoE layers, E experts.

BIAS_NAME = "e_score_correction_bias"


class RouterBiasError(ValueError):
    """The model has no score-correction bias, or not one per engine MoE layer."""


def router_biases(model: nn.Module) -> list[torch.Tensor]:
    """Each MoE layer's `e_score_correction_bias`, in module order (the order of the experts' counters)."""
    return [getattr(m, BIAS_NAME) for m in model.modules() if isinstance(getattr(m, BIAS_NAME, None), torch.Tensor)]


def check_router_bias(model: nn.Module, model_type: str | None, num_layers: int | None = None) -> list[torch.Tensor]:
    """The biases to update, or a clear error naming the option for a model without them."""
    from torch.distributed.tensor import DTensor

    biases = router_biases(model)
    if not biases:
        raise RouterBiasError(
            f"train.router_bias_update_rate > 0 needs a router with a score-correction bias "
            f"({BIAS_NAME}: deepseek_v3, glm4_moe, minimax_m2, ernie4_5_moe, ...), and model_type "
            f"{model_type!r} has none; set train.router_bias_update_rate to 0 (use the aux loss instead)"
        )
    if num_layers is not None and len(biases) != num_layers:
        raise RouterBiasError(
            f"model_type {model_type!r}: {len(biases)} {BIAS_NAME} tensors for {num_layers} MoE "
            "layers; the bias update needs one per MoE layer"
        )
    if any(isinstance(b, DTensor) for b in biases):
        raise RouterBiasError(
            f"model_type {model_type!r} holds {BIAS_NAME} as a sharded parameter; the bias "
            "update needs it replicated; set train.router_bias_update_rate to 0"
        )
    return biases


def cast_keeping_router_biases(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)` with each score-correction bias kept float32, values included.

    Transformers keeps it float32 in a bf16 model (`_keep_in_fp32_modules_strict`); a plain
    `.to(bfloat16)` would round the loaded or initialized values, so the routing would differ
    from Transformers' model of the same weights.
    """
    saved = [b.detach().float().clone() for b in router_biases(model)]  # module order, as router_biases gives
    model.to(dtype)
    keep_router_biases_fp32(model)
    with torch.no_grad():
        for bias, value in zip(router_biases(model), saved, strict=True):
            bias.copy_(value)
    return model


def keep_router_biases_fp32(model: nn.Module) -> None:
    """Make each score-correction bias float32 again after a `model.to(bfloat16)`.

    Transformers keeps it float32 (`_keep_in_fp32_modules_strict`); in bf16 a step of 1e-3 is lost
    once |bias| > 0.25 (8 mantissa bits), so the update would stall.
    """
    for module in model.modules():
        bias = getattr(module, BIAS_NAME, None)
        if not isinstance(bias, torch.Tensor) or bias.dtype == torch.float32:
            continue
        if BIAS_NAME in module._buffers:
            module._buffers[BIAS_NAME] = bias.float()
        else:  # ernie4_5_moe: a frozen parameter
            bias.data = bias.data.float()


def global_load(local_load_LE: torch.Tensor) -> torch.Tensor:
    """`[layers, experts]` counts summed over every rank (the whole global batch); int64."""
    load = local_load_LE.clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(load, op=dist.ReduceOp.SUM)
    return load


@torch.no_grad()
def update_router_biases(biases: list[torch.Tensor], load_LE: torch.Tensor, rate: float) -> None:
    """bias_e += rate * sign(mean load - load_e), per layer; `load_LE` the global counts."""
    if load_LE.shape[0] != len(biases):
        raise RouterBiasError(f"expert load of {load_LE.shape[0]} layers for {len(biases)} router biases")
    load = load_LE.double()
    step = rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
    for bias, row in zip(biases, step):
        bias.add_(row.to(device=bias.device, dtype=bias.dtype).view_as(bias))
