"""Point a Transformers model at a registered attention implementation, on its own copy of the config."""

from __future__ import annotations

import copy

from torch import nn


def use_attention_implementation(model: nn.Module, name: str) -> None:
    """Set `model`'s attention implementation to `name` (registered in Transformers' AttentionInterface).

    Transformers builds models around the caller's config object: switching it in place would also
    switch every other model built from that config (a reference model in a test, a benchmark's
    anchor), so the model first gets its own copy.
    """
    shared = model.config
    own = copy.deepcopy(shared)
    for module in model.modules():
        if getattr(module, "config", None) is shared:
            module.config = own
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(
            f"{type(model).__name__} did not accept attn_implementation={name!r}; "
            "it does not use Transformers' AttentionInterface"
        )
