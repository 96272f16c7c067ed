"""Qwen3-Next's engine Gated DeltaNet and decoder layer (class swaps: Transformers' parameters and state dict keys)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_next import modeling_qwen3_next as hf

from workbench.models.class_swap import swap_classes
from workbench.models.mixer_documents import MixerDocumentsLayer
from workbench.models.mixer_gated_delta import EngineGatedDeltaNet
from workbench.models.mixer_swap import swap_engine_mixers


class Qwen3NextEngineGatedDeltaNet(EngineGatedDeltaNet, hf.Qwen3NextGatedDeltaNet):
    """Transformers' Qwen3NextGatedDeltaNet whose training forward is the engine's chunked gated delta rule."""

    def projections(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q|k|v before the conv, z, b, a): the two fused projections, split per key head by the module's own rule."""
        q, k, v, z, b, a = self.fix_query_key_value_ordering(
            self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
        )
        mixed_qkv = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1)
        return mixed_qkv, z, b, a


class Qwen3NextEngineDecoderLayer(MixerDocumentsLayer, hf.Qwen3NextDecoderLayer):
    """Transformers' Qwen3NextDecoderLayer handing its position ids to its Gated DeltaNet (packed documents)."""


def use_engine_mixers(model: nn.Module, mixer: str) -> int:
    """mixer='chunked': the engine's Gated DeltaNets and the layers that feed them documents; how many mixers."""
    swapped = swap_engine_mixers(
        model, mixer, hf.Qwen3NextGatedDeltaNet, Qwen3NextEngineGatedDeltaNet, "Gated DeltaNet"
    )
    if swapped:
        swap_classes(model, hf.Qwen3NextDecoderLayer, Qwen3NextEngineDecoderLayer)
    return swapped
