"""Qwen4-Exp's engine Gated DeltaNet (a class swap: Transformers' parameters and state dict keys).

No decoder layer swap: Qwen4ExpTextModel calls its layers without position ids, so there are none to hand on."""

from __future__ import annotations

from torch import nn
from transformers.models.qwen4_exp import modeling_qwen4_exp as hf

from workbench.models.mixer_gated_delta import EngineGatedDeltaNet
from workbench.models.mixer_swap import swap_engine_mixers


class Qwen4ExpEngineGatedDeltaNet(EngineGatedDeltaNet, hf.Qwen4ExpTextGatedDeltaNet):
    """Transformers' Qwen4ExpTextGatedDeltaNet whose training forward is the engine's chunked gated delta rule."""


def use_engine_mixers(model: nn.Module, mixer: str) -> int:
    """mixer='chunked': the engine's Gated DeltaNets; how many."""
    return swap_engine_mixers(model, mixer, hf.Qwen4ExpTextGatedDeltaNet, Qwen4ExpEngineGatedDeltaNet, "Gated DeltaNet")
