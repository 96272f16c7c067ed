"""Swap the class of a model's modules of one exact Transformers class for an engine subclass (same parameters).

A class swap, not a wrapper: parameter names and state dict keys stay Transformers', and the model's own output
recording (router logits, attention weights) still finds its modules.
"""

from __future__ import annotations

from torch import nn


def swap_classes(model: nn.Module, hf_class: type, engine_class: type, **attrs) -> int:
    """Every module of exactly `hf_class` in `model` becomes `engine_class` with `attrs` set; how many."""
    if not issubclass(engine_class, hf_class):
        raise TypeError(f"{engine_class.__name__} must subclass {hf_class.__name__} (it keeps its parameters)")
    swapped = 0
    for module in model.modules():
        if type(module) is hf_class:
            module.__class__ = engine_class
            for name, value in attrs.items():
                setattr(module, name, value)
            swapped += 1
    return swapped
