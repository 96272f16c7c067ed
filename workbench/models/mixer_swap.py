"""Which sequence mixers of a model the engine takes over: every module of a family's mixer class, where
BackendConfig.mixer is 'chunked' or 'triton' and the engine's conv (SiLU) computes what the module's does."""

from __future__ import annotations

from torch import nn

from workbench.models.class_swap import swap_classes

# The mixer choices the engine's modules serve; 'triton' also walks the gated delta rule's chunks in Triton (an
# engine Gated DeltaNet's `triton_walk` field), and is 'chunked' for a Mamba2, whose scan has no walk.
ENGINE_MIXERS = ("chunked", "triton")


def swap_engine_mixers(model: nn.Module, mixer: str, hf_class: type, engine_class: type, kind: str) -> int:
    """mixer 'chunked' or 'triton': every `hf_class` module of `model` becomes `engine_class` (same parameters), its
    `triton_walk` field (where it has one) set for 'triton'; how many.

    `kind` names the mixer (Mamba2, Gated DeltaNet) in the refusal of a conv or output gate activation other than
    SiLU.
    """
    if mixer not in ENGINE_MIXERS:
        return 0
    unsupported = {a for m in model.modules() if type(m) is hf_class for a in _other_than_silu(m)}
    if unsupported:
        raise ValueError(
            f"mixer={mixer!r} runs {kind}'s conv and output gate with SiLU; this model's {hf_class.__name__} uses "
            f"{sorted(unsupported)}: set BackendConfig.mixer='transformers'"
        )
    swapped = swap_classes(model, hf_class, engine_class)
    if hasattr(engine_class, "triton_walk"):
        for module in model.modules():
            if isinstance(module, engine_class):
                module.triton_walk = mixer == "triton"
    return swapped


def _other_than_silu(module: nn.Module) -> list[str]:
    """The module's conv activation and its gated norm's, where either is not the SiLU the engine computes.

    A gated norm without an `activation` field hard-codes SiLU (Transformers' Mamba2 norms); a Gated DeltaNet's
    names it, and Qwen4-Exp's config may set it to sigmoid (output_gate_type)."""
    gate = getattr(getattr(module, "norm", None), "activation", "silu")
    return [f"{where} {act}" for where, act in (("conv", module.activation), ("output gate", gate)) if act != "silu"]
