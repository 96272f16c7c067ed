"""Which sequence mixers of a model the engine takes over: every module of a family's mixer class, where
BackendConfig.mixer is 'chunked' and the engine's conv (SiLU) computes what the module's does."""

from __future__ import annotations

from torch import nn

from workbench.models.class_swap import swap_classes


def swap_engine_mixers(model: nn.Module, mixer: str, hf_class: type, engine_class: type, kind: str) -> int:
    """mixer='chunked': every `hf_class` module of `model` becomes `engine_class` (same parameters); how many.

    `kind` names the mixer (Mamba2, Gated DeltaNet) in the refusal of a conv activation other than SiLU.
    """
    if mixer != "chunked":
        return 0
    unsupported = {m.activation for m in model.modules() if type(m) is hf_class and m.activation != "silu"}
    if unsupported:
        raise ValueError(
            f"mixer='chunked' runs {kind}'s conv with SiLU; this model's {hf_class.__name__} uses "
            f"{sorted(unsupported)}: set BackendConfig.mixer='transformers'"
        )
    return swap_classes(model, hf_class, engine_class)
