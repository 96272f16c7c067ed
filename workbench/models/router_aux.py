"""The router aux loss apart from the cross-entropy: one forward gives both, neither derived from the other.

Transformers' MoE causal LMs asked for router logits add router_aux_loss_coef x aux to `loss` in
place; without them `loss` is the cross-entropy alone. So `forward_loss_parts` runs the forward
without output_router_logits, records each router's logits with forward hooks on the modules
Transformers itself records (`_can_record_outputs`), and computes the aux loss once from them
(moe/router.load_balancing_loss, Transformers' formula for every family that has an aux loss).
The trainer takes the two parts from here; the engine's forward (generic_extras) adds them for
`model(...).loss` as Transformers does.
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from workbench.models.engine_state import engine_state
from workbench.models.router_records import RecordsTopkIds, RouterLogitSink
from workbench.moe.router import load_balancing_loss


def _router_logit_specs(model: nn.Module) -> list[tuple[type, int]]:
    """(module class, output index) that Transformers records as `router_logits` (its `_can_record_outputs`)."""
    specs = (getattr(model.base_model, "_can_record_outputs", None) or {}).get("router_logits")
    out = []
    for spec in specs if isinstance(specs, list) else [specs] if specs is not None else []:
        if isinstance(spec, type):
            out.append((spec, 1))  # Transformers' index for a bare class outside hidden_states
        elif isinstance(getattr(spec, "target_class", None), type) and getattr(spec, "layer_name", None) is None:
            out.append((spec.target_class, int(spec.index)))
    return out


def _record_router_logits(sink: RouterLogitSink, index: int, ids_index: int | None, module, args, output) -> None:
    if sink.logits is not None:
        sink.logits.append(output[index] if isinstance(output, tuple) else output)
        if sink.topk_ids is not None and ids_index is not None and isinstance(output, tuple):
            sink.topk_ids.append(output[ids_index])


def attach_router_logit_hooks(model: nn.Module) -> int:
    """Record each router's logits into the model's router sink (its EngineState) while it collects; how many routers.

    The modules are the ones Transformers' own output recording hooks (the same class and output
    index), so the logits are those its aux loss would read.
    """
    sink = RouterLogitSink()
    specs = _router_logit_specs(model)
    routers = 0
    for module in model.base_model.modules():
        index = next((i for cls, i in specs if isinstance(module, cls)), None)
        if index is not None:
            ids_index = module.topk_ids_index if isinstance(module, RecordsTopkIds) else None
            module.register_forward_hook(functools.partial(_record_router_logits, sink, index, ids_index))
            routers += 1
    if not routers:
        raise RuntimeError(
            f"model_type {model.config.model_type!r}: no router module found from Transformers' "
            f"_can_record_outputs['router_logits'] ({specs}); the shared aux loss needs them"
        )
    engine_state(model).router_sink = sink
    return routers


def _normalized_source(fn) -> str | None:
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    source = re.sub(r'""".*?"""', "", source, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"#.*", "", source))


def has_standard_aux_loss(hf_class: type) -> bool:
    """Whether the family's aux loss is Transformers' Switch-style one (moe/router.load_balancing_loss's formula).

    Read from the family's modeling module (the first class up the MRO that has one, so a class
    FSDP2 or the engine derived from it counts too): its `load_balancing_loss_func` must be
    Qwen3-MoE's, the one moe/router reproduces (tests/test_router.py); Mixtral, OLMoE,
    Qwen2/3/3.5-MoE, GPT-OSS, MiniMax-M2, ERNIE-4.5-MoE share it in 5.24. Families without one
    (DeepSeek-V3) have no aux loss.
    """
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    ref = modeling_qwen3_moe.load_balancing_loss_func
    for cls in hf_class.__mro__:
        fn = getattr(sys.modules.get(cls.__module__), "load_balancing_loss_func", None)
        if fn is not None:
            return fn is ref or (
                _normalized_source(fn) is not None and _normalized_source(fn) == _normalized_source(ref)
            )
    return False


def records_router_logits(model: nn.Module) -> bool:
    """Whether Transformers records `model`'s router logits from router modules (what the engine's hooks need).

    Transformers 5.17's GraniteMoE, for one, returns them from its own layer loop instead (no module in
    `_can_record_outputs`): such a family keeps Transformers' aux loss.
    """
    return bool(_router_logit_specs(model))


def ensure_router_logit_hooks(model: nn.Module) -> bool:
    """Give a Transformers model with the standard aux loss its router hooks (the engine's has them); whether it has."""
    if engine_state(model).router_sink is not None:
        return True
    if not (has_standard_aux_loss(type(model)) and records_router_logits(model)):
        return False
    attach_router_logit_hooks(model)
    return True


@dataclass(frozen=True)
class LossParts:
    """One forward's output, its cross-entropy (None without labels) and aux loss (None: the model has none)."""

    out: Any
    ce: torch.Tensor | None
    aux: torch.Tensor | None
    router_logits: tuple[torch.Tensor, ...]


def forward_loss_parts(model: nn.Module, forward: Callable[..., Any], kwargs: dict[str, Any], group=None) -> LossParts:
    """`forward(**kwargs)` without router logits (its loss is the cross-entropy) and the aux loss computed once.

    `model` is the module whose router hooks record (ensure_router_logit_hooks; without them it has
    no aux loss). With a data-parallel `group`, the aux loss is this rank's share of the aux loss
    of the micro-batch across the group (load_balancing_loss: counts summed over the group), so
    shares and gradients add up to the global batch's, as one process computes it.
    """
    sink = engine_state(model).router_sink
    kwargs = {**kwargs, "output_router_logits": False}
    if sink is None:
        out = forward(**kwargs)
        return LossParts(out, out.loss, None, ())
    sink.logits, sink.topk_ids = [], []
    try:
        out = forward(**kwargs)
        logits, ids = tuple(sink.logits), tuple(sink.topk_ids)
    finally:
        sink.logits = sink.topk_ids = None  # a recompute in backward (activation checkpointing) records nothing
    aux = load_balancing_loss(
        logits,
        model.num_experts,
        model.num_experts_per_tok,
        kwargs.get("attention_mask"),
        group=group,
        topk_ids=ids if len(ids) == len(logits) else None,  # every router gave its ids, or none are used
    )
    return LossParts(out, out.loss, aux, logits)
