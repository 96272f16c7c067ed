"""Casting an engine model to its training dtype as Transformers' own `dtype=` build leaves it.

Transformers computes rotary frequencies (`inv_freq`, `original_inv_freq`: non-persistent buffers, never
loaded) in float32 and keeps them float32 in a bf16 model (5.24 keeps DeepSeek-V3's score-correction bias
float32 too; the engine always does). A plain `model.to(bfloat16)` rounds both: the frequencies lose up to ~0.2%
each, so the rotation angle at position p is off by up to ~2e-3 * p radians (~6 rad at p = 4096 in Qwen3's
second-fastest dims). On the H200 that put the engine's bf16 gradients of a 2-layer Qwen3-30B-A3B at seq 4096
2-5x further from float32 than Transformers' own bf16 model's (benchmarks/grad_parity.py, 2026-12-04), where in
float32 they agree to ~3e-6.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.moe.bias_update import cast_keeping_router_biases


def computed_float32_buffers(module: nn.Module, recurse: bool = True) -> list[tuple[nn.Module, str]]:
    """(module, name) of each float32 buffer that is not saved with the weights (rotary frequencies)."""
    modules = module.modules() if recurse else [module]
    return [
        (m, name)
        for m in modules
        for name, buf in m._buffers.items()
        if buf is not None and buf.dtype == torch.float32 and name in m._non_persistent_buffers_set
    ]


def cast_like_transformers(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model.to(dtype)` keeping the float32 buffers Transformers keeps: computed ones and score-correction biases."""
    kept = [(m, name, m._buffers[name]) for m, name in computed_float32_buffers(model)]
    cast_keeping_router_biases(model, dtype)
    for m, name, buf in kept:
        m._buffers[name] = buf
    return model
