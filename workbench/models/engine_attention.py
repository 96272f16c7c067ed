"""What the engine's attention classes (Qwen3-MoE's fused RoPE, DeepSeek-V3's fused MLA q/k/v) share.

Each runs its own training forward only where it stands for Transformers' exactly: rope='triton', no KV cache
and no extra positional arguments; and it calls the attention function Transformers' own forward would call.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from torch import nn


def engine_forward_applies(module: nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether `module` (an engine attention) runs its own forward: rope='triton', no cache, no positional extras."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return not args and cache is None and getattr(module, "workbench_rope", "torch") == "triton"


def attention_function(family: ModuleType, impl: str) -> Callable:
    """The attention function of `impl` as the family's modeling module looks it up (5.17 and 5.2x registries)."""
    registry = family.ALL_ATTENTION_FUNCTIONS
    if hasattr(registry, "get_interface"):  # transformers >= 5.2x
        return registry.get_interface(impl, family.eager_attention_forward)
    return family.eager_attention_forward if impl == "eager" else registry[impl]


def wants_engine_attention(rope: str) -> bool:
    """Whether a resolved BackendConfig.rope asks for the engine's attention classes ('triton'; 'torch': no)."""
    if rope not in ("torch", "triton"):
        raise ValueError(f"rope must be a resolved BackendConfig.rope, 'torch' or 'triton'; got {rope!r}")
    return rope == "triton"
