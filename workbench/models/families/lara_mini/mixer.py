"""Lara-Mini's engine Gated DeltaNet and decoder layer (class swaps: Transformers' parameters and state dict keys)."""

from __future__ import annotations

from torch import nn
from transformers.models.lara_mini import modeling_lara_mini as hf

from workbench.models.class_swap import swap_classes
from workbench.models.mixer_documents import MixerDocumentsLayer
from workbench.models.mixer_gated_delta import EngineGatedDeltaNet
from workbench.models.mixer_swap import swap_engine_mixers


class LaraMiniEngineGatedDeltaNet(EngineGatedDeltaNet, hf.LaraMiniGatedDeltaNet):
    """Transformers' LaraMiniGatedDeltaNet whose training forward is the engine's chunked gated delta rule."""


class LaraMiniEngineDecoderLayer(MixerDocumentsLayer, hf.LaraMiniDecoderLayer):
    """Transformers' LaraMiniDecoderLayer handing its position ids to its Gated DeltaNet (packed documents)."""


def use_engine_mixers(model: nn.Module, mixer: str) -> int:
    """mixer='chunked': the engine's Gated DeltaNets and the layers that feed them documents; how many mixers."""
    swapped = swap_engine_mixers(model, mixer, hf.LaraMiniGatedDeltaNet, LaraMiniEngineGatedDeltaNet, "Gated DeltaNet")
    if swapped:
        swap_classes(model, hf.LaraMiniDecoderLayer, LaraMiniEngineDecoderLayer)
    return swapped
