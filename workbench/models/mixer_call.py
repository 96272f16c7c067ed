"""What an engine sequence mixer reads from Transformers' call of the mixer it replaces (5.17 through 5.25).

Transformers' decoder layers call a linear-attention mixer as `mixer(hidden_states, cache=..., attention_mask=...,
**kwargs)`; 5.17 names the cache `cache_params`, later versions `cache` (with `cache_params` deprecated).
"""

from __future__ import annotations

import torch

_CACHE_KEYS = ("cache", "cache_params", "past_key_values")


def call_cache(args: tuple, kwargs: dict):
    """The cache of the call (positional after hidden_states, or by any of its names); None without one."""
    if args and args[0] is not None:
        return args[0]
    return next((kwargs[k] for k in _CACHE_KEYS if kwargs.get(k) is not None), None)


def padding_mask(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The 2D padding mask [B, S] of the call (1 = token, 0 = padding), or None (Transformers' None: no padding)."""
    mask = args[1] if len(args) > 1 else kwargs.get("attention_mask")
    return mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
