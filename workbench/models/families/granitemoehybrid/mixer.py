"""GraniteMoE-Hybrid's engine Mamba2 mixer and decoder layer (class swaps: Transformers' parameters and state dict
keys)."""

from __future__ import annotations

from torch import nn
from transformers.models.granitemoehybrid import modeling_granitemoehybrid as hf

from workbench.models.class_swap import swap_classes
from workbench.models.mixer_documents import MixerDocumentsLayer
from workbench.models.mixer_mamba2 import EngineMamba2Mixer
from workbench.models.mixer_swap import swap_engine_mixers


class GraniteMoeHybridEngineMambaLayer(EngineMamba2Mixer, hf.GraniteMoeHybridMambaLayer):
    """Transformers' GraniteMoeHybridMambaLayer whose training forward is the engine's chunked scan."""


class GraniteMoeHybridEngineDecoderLayer(MixerDocumentsLayer, hf.GraniteMoeHybridDecoderLayer):
    """Transformers' GraniteMoeHybridDecoderLayer handing its position ids to its Mamba2 mixer (packed documents)."""


def use_engine_mixers(model: nn.Module, mixer: str) -> int:
    """mixer='chunked': the engine's Mamba2 mixers and the layers that feed them documents; how many mixers."""
    swapped = swap_engine_mixers(
        model, mixer, hf.GraniteMoeHybridMambaLayer, GraniteMoeHybridEngineMambaLayer, "Mamba2"
    )
    if swapped:
        swap_classes(model, hf.GraniteMoeHybridDecoderLayer, GraniteMoeHybridEngineDecoderLayer)
    return swapped
