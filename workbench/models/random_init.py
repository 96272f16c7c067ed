"""A seeded random-init build one decoder layer at a time: the float32 draw never holds the whole model.

Transformers draws its init in float32, and so does models/generic.init_random (seeded per module and
per expert, the same on any mesh). Materializing the whole meta model in float32 first put the full
48-layer Qwen3-30B-A3B at 122 GB on the GPU before the cast to bf16; materialized, drawn and cast a
block at a time the build peaks at the bf16 model plus one float32 layer.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.models import generic
from workbench.models.cast import cast_like_transformers, computed_float32_buffers


def decoder_layer_names(model: nn.Module) -> list[str]:
    """Names of the decoder layers: the children of the model's largest ModuleList (`model.layers`)."""
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return []
    name, layers = max(lists, key=lambda item: len(item[1]))
    return [f"{name}.{i}" for i in range(len(layers))]


def _inside(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def materialize_random(model: nn.Module, device: torch.device, seed: int, dtype: torch.dtype | None) -> None:
    """Give meta `model` storage on `device`, draw init_random's weights in float32, cast to `dtype`; by block.

    The values equal a whole-model `to_empty` + `init_random` + cast: each module is seeded by its
    name, so the order of the blocks does not matter.
    """
    layers = decoder_layer_names(model)

    def in_layer(name: str) -> bool:
        return any(_inside(name, layer) for layer in layers)

    # Everything outside the layers first (embeddings, final norm, LM head, rotary buffers): small.
    outside = [(name, m) for name, m in model.named_modules() if not in_layer(name)]
    for _, module in outside:
        module.to_empty(device=device, recurse=False)
    generic.init_random(model, seed, only=lambda name: not in_layer(name))
    if dtype is not None:
        for _, module in outside:
            _cast_own(module, dtype)
    for layer in layers:
        block = model.get_submodule(layer)
        block.to_empty(device=device)
        generic.init_random(model, seed, only=lambda name, layer=layer: _inside(name, layer))
        if dtype is not None:
            cast_like_transformers(block, dtype)


def _cast_own(module: nn.Module, dtype: torch.dtype) -> None:
    # What module.to(dtype) does to the module's own floating-point parameters and buffers, without
    # recursing: a child still on meta would be cast there and then drawn in bf16. Computed float32 buffers
    # (rotary frequencies) stay float32, as in Transformers' own bf16 models (models/cast.py).
    for param in module.parameters(recurse=False):
        if param.is_floating_point():
            param.data = param.data.to(dtype)
    kept = {name for _, name in computed_float32_buffers(module, recurse=False)}
    for name, buf in list(module.named_buffers(recurse=False)):
        if buf.is_floating_point() and name not in kept:
            module._buffers[name] = buf.to(dtype)
