"""Qwen3.5-MoE's engine Gated DeltaNet and decoder layer (class swaps: Transformers' parameters and state dict keys)."""

from __future__ import annotations

from torch import nn
from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as hf

from workbench.models.class_swap import swap_classes
from workbench.models.mixer_documents import MixerDocumentsLayer
from workbench.models.mixer_gated_delta import EngineGatedDeltaNet
from workbench.models.mixer_swap import swap_engine_mixers


class Qwen3_5MoeEngineGatedDeltaNet(EngineGatedDeltaNet, hf.Qwen3_5MoeGatedDeltaNet):
    """Transformers' Qwen3_5MoeGatedDeltaNet whose training forward is the engine's chunked gated delta rule."""


class Qwen3_5MoeEngineDecoderLayer(MixerDocumentsLayer, hf.Qwen3_5MoeDecoderLayer):
    """Transformers' Qwen3_5MoeDecoderLayer handing its position ids to its Gated DeltaNet (packed documents)."""


def use_engine_mixers(model: nn.Module, mixer: str) -> int:
    """mixer='chunked': the engine's Gated DeltaNets and the layers that feed them documents; how many mixers."""
    swapped = swap_engine_mixers(
        model, mixer, hf.Qwen3_5MoeGatedDeltaNet, Qwen3_5MoeEngineGatedDeltaNet, "Gated DeltaNet"
    )
    if swapped:
        swap_classes(model, hf.Qwen3_5MoeDecoderLayer, Qwen3_5MoeEngineDecoderLayer)
    return swapped
