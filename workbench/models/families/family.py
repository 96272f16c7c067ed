"""What one Transformers model family adds to the generic engine path: one frozen record per family folder.

The generic path (models/generic.py) runs every Transformers v5 MoE family with fused experts as it is; a family
that adds something (its presets, an engine attention or router class, its own experts kernel, a parameter the
counts must know, its tests' tiny config) says so in a `Family` in its folder, models/families/<model_type>/, and
registers it with one line in models/families/__init__.py. Every field has a default that adds nothing, so a
family names only what it adds. This module stays free of torch and Transformers: presets and parameter counts
are read without building a model (the engine modules a family installs are imported when a model is built).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from workbench.models.families.preset import Preset

if TYPE_CHECKING:
    from torch import nn


@dataclass(frozen=True)
class AttentionWidths:
    """One attention block's head counts and head width, as the parameter counts (workbench/params.py) hand them."""

    heads: int
    kv_heads: int
    head_dim: int


# The sequence mixers a decoder layer may hold, and its MLPs (LayerBlocks).
SEQUENCE_MIXERS = ("attention", "mamba2", "gated_deltanet")
MLPS = ("moe", "dense")


@dataclass(frozen=True)
class LayerBlocks:
    """What one decoder layer holds, for the parameter counts, the FLOPs and the memory estimate: its sequence mixer
    (`attention`, `mamba2`, `gated_deltanet` or None) and its MLP (`moe`, `dense` or None); each block has its
    pre-norm. A transformer layer is attention + MoE or dense MLP; a hybrid's layer may hold one block only."""

    mixer: str | None = "attention"
    mlp: str | None = "moe"

    def __post_init__(self) -> None:
        if self.mixer not in (*SEQUENCE_MIXERS, None) or self.mlp not in (*MLPS, None):
            raise ValueError(
                f"LayerBlocks({self.mixer!r}, {self.mlp!r}): the mixer is one of {SEQUENCE_MIXERS} or None, "
                f"the mlp one of {MLPS} or None"
            )


def no_extras(model: nn.Module, backend: Any) -> dict[str, int]:
    """A family without engine modules of its own: nothing installed."""
    return {}


def no_expert_rows(module: nn.Module, swiglu: str) -> Callable | None:
    """A family without an experts kernel of its own: the generic rows (moe/hf_experts.expert_rows) run."""
    return None


def no_attention_params(widths: AttentionWidths) -> int:
    """A family whose attention holds only its projections and their biases."""
    return 0


@dataclass(frozen=True)
class Family:
    """One model_type's additions to the generic path; the defaults add nothing.

    - `presets`: its named architectures, in the Studio picker's order (tiny first).
    - `test_config`: the config fields of the tiny model the tests build for it (tests/generic_families.py).
    - `install_extras(model, backend)`: swap in the family's engine modules where the resolved BackendConfig asks
      for them (class swaps: parameter names unchanged); how many modules each extra changed, by extra name.
    - `expert_rows(experts_module, swiglu)`: the family's own experts computation on expert-major rows for this
      experts module and resolved BackendConfig.swiglu (GPT-OSS's fused gate), or None for the generic rows.
      Asked once per experts module, at install.
    - `sinks_by_default`: attention='auto' runs the engine's sink attention (models/attention_sinks.py).
    - `attention_params(widths)`: parameters one attention block holds beyond its projections and their biases
      (per-head norms, sinks).
    - `biased_experts`: the router and both expert projections carry biases.
    - `experts_forwards`: experts classes whose own forward wraps Transformers' decorated one with steps of its own
      (Ergo's per-expert norm) and that the family's `expert_rows` reproduce; the engine refuses any other such class.
    - `layer_blocks(config, moe_flags)`: each decoder layer's LayerBlocks, for a hybrid whose layers differ (its
      sequence mixers, layers of one block); `moe_flags`: which layers the generic rule gives experts. None: every
      layer is attention plus an MoE (where moe_flags says) or a dense MLP.
    - `gated_mlps`: its MLPs and experts have a gate projection (SwiGLU: 3 matrices); False: up and down only
      (Nemotron-H's relu²).
    - `gated_query`: its attention's query projection also gives a per-head output gate (2x its width).
    - `shared_expert_gate`: its shared expert's output passes a sigmoid gate, an nn.Linear(hidden, 1).
    - `qk_norm`: its attention normalizes the queries and keys before the rotary embedding (Qwen3's per-head norms,
      OLMoE's over all heads): the backward keeps their inputs too (the memory estimate).
    """

    model_type: str
    name: str
    presets: tuple[Preset, ...] = ()
    test_config: Mapping[str, Any] = field(default_factory=dict)
    install_extras: Callable[[nn.Module, Any], dict[str, int]] = no_extras
    expert_rows: Callable[[nn.Module, str], Callable | None] = no_expert_rows
    sinks_by_default: bool = False
    attention_params: Callable[[AttentionWidths], int] = no_attention_params
    biased_experts: bool = False
    experts_forwards: tuple[str, ...] = ()
    layer_blocks: Callable[[Any, list[bool]], tuple[LayerBlocks, ...]] | None = None
    gated_mlps: bool = True
    gated_query: bool = False
    shared_expert_gate: bool = False
    qk_norm: bool = False

    def __post_init__(self) -> None:
        others = [p.name for p in self.presets if p.model_type != self.model_type]
        if others:
            raise ValueError(f"family {self.model_type!r} lists presets of another model_type: {others}")
        object.__setattr__(self, "presets", tuple(self.presets))
        object.__setattr__(self, "test_config", MappingProxyType(dict(self.test_config)))
