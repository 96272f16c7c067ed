"""Swap the class of a model's modules of one exact Transformers class for an engine subclass (same parameters).

A class swap, not a wrapper: parameter names and state dict keys stay Transformers', and the model's own output
recording (router logits, attention weights) still finds its modules.
"""

from __future__ import annotations

import inspect

from torch import nn


def _declared_fields(cls: type) -> set[str]:
    """The annotated fields of `cls` and the classes it derives from."""
    return {name for klass in cls.__mro__ for name in inspect.get_annotations(klass)}


def swap_classes(model: nn.Module, hf_class: type, engine_class: type, **fields) -> int:
    """Every module of exactly `hf_class` in `model` becomes `engine_class` with `fields` set; how many.

    `fields` are fields `engine_class` declares (with their defaults), never new attributes on Transformers' module.
    """
    if not issubclass(engine_class, hf_class):
        raise TypeError(f"{engine_class.__name__} must subclass {hf_class.__name__} (it keeps its parameters)")
    undeclared = sorted(name for name in fields if name not in _declared_fields(engine_class))
    if undeclared:
        raise TypeError(f"{engine_class.__name__} declares no field {', '.join(undeclared)}")
    swapped = 0
    for module in model.modules():
        if type(module) is hf_class:
            module.__class__ = engine_class
            for name, value in fields.items():
                setattr(module, name, value)
            swapped += 1
    return swapped
