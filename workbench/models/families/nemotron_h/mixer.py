"""Nemotron-H's engine Mamba2 mixer and decoder block (class swaps: Transformers' parameters and state dict keys)."""

from __future__ import annotations

from torch import nn
from transformers.models.nemotron_h import modeling_nemotron_h as hf

from workbench.models.class_swap import swap_classes
from workbench.models.mixer_documents import MixerDocumentsLayer
from workbench.models.mixer_mamba2 import EngineMamba2Mixer
from workbench.models.mixer_swap import swap_engine_mixers


class NemotronHEngineMamba2Mixer(EngineMamba2Mixer, hf.NemotronHMamba2Mixer):
    """Transformers' NemotronHMamba2Mixer whose training forward is the engine's chunked scan."""


class NemotronHEngineBlock(MixerDocumentsLayer, hf.NemotronHBlock):
    """Transformers' NemotronHBlock handing its position ids to its Mamba2 mixer (packed documents)."""


def use_engine_mixers(model: nn.Module, mixer: str) -> int:
    """mixer='chunked': the engine's Mamba2 mixers and the blocks that feed them documents; how many mixers."""
    swapped = swap_engine_mixers(model, mixer, hf.NemotronHMamba2Mixer, NemotronHEngineMamba2Mixer, "Mamba2")
    if swapped:
        swap_classes(model, hf.NemotronHBlock, NemotronHEngineBlock)
    return swapped
