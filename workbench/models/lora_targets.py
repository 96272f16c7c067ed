"""Which modules and parameters of a Transformers MoE model each `lora.targets` entry names.

Found from what the modules are, not from the names a family gives its blocks (Nemotron-H names every block
`mixer`, Gemma 4 puts its experts beside the dense MLP in the decoder layer itself): in every decoder layer,
- experts: every v5 fused experts module (@use_experts_implementation), their up (gate+up) and down weights;
- mixer: every sequence mixer that is not softmax attention - a recurrence with a decay (a learned `A_log`: Mamba,
  Mamba2, Gated DeltaNet, Kimi's delta attention; fixed `slope_rate` decays: MiniMax's lightning attention) or a
  short convolution (a Conv1d beside its projections: LFM2) - its nn.Linears (in_proj, out_proj, ...);
- attention: every module Transformers' attention functions run on (it carries the `is_causal` and `scaling` they
  read: MHA, GQA, MLA, sliding), its nn.Linears (q/k/v/o, MLA's q_a/q_b/kv_a/kv_b);
- shared_experts: in a layer with experts, the MLPs beside them (a class named `...MLP` or `...SharedExpert(s)`, or
  a child named shared_expert(s)/shared_mlp) in the layer or the experts' block, their nn.Linears;
- dense_mlp: in a layer without experts, its MLP's nn.Linears;
- router: the experts' router (a child named gate/router of the experts' block) where it is an nn.Linear.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from workbench.config_checks import ConfigError
from workbench.moe.hf_experts import is_fused_experts, layout_of
from workbench.parallel.fsdp import decoder_layers

SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")  # a layer's MLP where its class does not say so
ROUTER_NAMES = ("gate", "router")
MLP_CLASS_ENDINGS = ("MLP", "SharedExpert", "SharedExperts")

# Why a target matched nothing, named in the refusal.
MISSING_HINTS = {
    "router": "its router is not an nn.Linear",
    "dense_mlp": "it has no dense (non-MoE) layers",
    "shared_experts": "it has no shared experts",
    "experts": "it has no fused experts modules",
    "attention": "no attention module (a class named ...Attention) holds an nn.Linear",
    "mixer": (
        "it has no sequence mixers besides attention (Mamba/Mamba2, Gated DeltaNet, short convolutions); "
        "the attention projections are the 'attention' target"
    ),
}


@dataclass(frozen=True)
class LoraPlan:
    """The full names of what gets adapters: nn.Linear modules, and (experts module, parameter names)."""

    linears: tuple[str, ...]
    experts: tuple[tuple[str, tuple[str, ...]], ...]
    by_target: tuple[tuple[str, int], ...]  # (target, how many modules it matched)


@dataclass
class _LayerParts:
    """One decoder layer's modules by role: (full name, module) each."""

    experts: list = field(default_factory=list)
    mixer: list = field(default_factory=list)
    attention: list = field(default_factory=list)
    mlps: list = field(default_factory=list)  # the MLPs outside the experts' blocks
    routers: list = field(default_factory=list)  # nn.Linear routers of the experts' blocks


def _class_names(module: nn.Module) -> list[str]:
    # along the class hierarchy: an engine or FSDP subclass (FSDPQwen3MoeAttention) is still what it replaced
    return [cls.__name__ for cls in type(module).__mro__ if cls not in (nn.Module, object)]


def is_attention(module: nn.Module) -> bool:
    """Whether `module` is an attention Transformers' attention functions run on: it carries the `is_causal` and
    `scaling` they read (its class name varies: LongcatFlashMLA; delta-rule and lightning attention carry neither)."""
    return hasattr(module, "is_causal") and hasattr(module, "scaling")


def is_sequence_mixer(module: nn.Module) -> bool:
    """Whether `module` is a sequence mixer other than softmax attention: a recurrence with a decay (a learned `A_log`
    anywhere in it: Mamba, Mamba2, Gated DeltaNet, Kimi's delta attention; fixed `slope_rate` decays: MiniMax's
    lightning attention) or a short convolution (a Conv1d child beside nn.Linear children: LFM2's conv block)."""
    if any(name.rsplit(".", 1)[-1] == "A_log" for name, _ in module.named_parameters()):
        return True
    if any(name.rsplit(".", 1)[-1] == "slope_rate" for name, _ in module.named_buffers()):
        return True
    children = list(module.children())
    return any(isinstance(c, nn.Conv1d) for c in children) and any(type(c) is nn.Linear for c in children)


def _is_mlp(name: str, module: nn.Module) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf in SHARED_NAMES + MLP_NAMES or any(n.endswith(MLP_CLASS_ENDINGS) for n in _class_names(module))


def _holds_experts(module: nn.Module) -> bool:
    return any(is_fused_experts(m) for m in module.modules())


def _collect(prefix: str, module: nn.Module, parts: _LayerParts, experts_block: bool, mlps_here: bool = True) -> None:
    """Sort `module`'s children into `parts`, descending only into modules no role claims.

    `experts_block`: `module` holds the experts (their block, or a layer holding them itself, as Gemma 4's).
    `mlps_here`: its MLPs are the layer's (the layer, the experts' block and module lists in them); inside any
    other module an MLP is a part of that module (AXK2's gated norm), not a shared expert or a dense MLP.
    """
    for child_name, child in module.named_children():
        full = f"{prefix}.{child_name}"
        if is_fused_experts(child):
            parts.experts.append((full, child))
        elif is_sequence_mixer(child):
            parts.mixer.append((full, child))
        elif is_attention(child):
            parts.attention.append((full, child))
        elif _holds_experts(child):
            _collect(full, child, parts, experts_block=True)
        elif experts_block and child_name in ROUTER_NAMES:
            if type(child) is nn.Linear:
                parts.routers.append((full, child))
        elif mlps_here and _is_mlp(child_name, child):
            parts.mlps.append((full, child))
        else:
            container = isinstance(child, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
            _collect(full, child, parts, experts_block=False, mlps_here=mlps_here and container)


def _linears_under(prefix: str, module: nn.Module) -> list[str]:
    if type(module) is nn.Linear:
        return [prefix]
    return [f"{prefix}.{n}" for n, m in module.named_modules() if n and type(m) is nn.Linear]


def plan_lora(model: nn.Module, targets: tuple[str, ...]) -> LoraPlan:
    """What each of `targets` names in `model` (vanilla or with the engine installed)."""
    layer_names = {id(m): n for n, m in model.named_modules()}
    found: dict[str, list] = {t: [] for t in targets}
    for layer in decoder_layers(model):
        parts = _LayerParts()
        _collect(layer_names[id(layer)], layer, parts, experts_block=_holds_experts(layer))
        linear_roles = {
            "attention": parts.attention,
            "mixer": parts.mixer,
            # an MLP beside the experts is a shared expert; in a layer without experts it is the dense MLP
            "shared_experts": parts.mlps if parts.experts else [],
            "dense_mlp": [] if parts.experts else parts.mlps,
            "router": parts.routers,
        }
        for target, modules in linear_roles.items():
            if target in found:
                for name, module in modules:
                    found[target] += _linears_under(name, module)
        if "experts" in found:
            for name, module in parts.experts:
                found["experts"].append((name, (layout_of(module).up_name, "down_proj")))
    linears = tuple(n for t in targets if t != "experts" for n in found[t])
    return LoraPlan(
        linears=linears, experts=tuple(found.get("experts", ())), by_target=tuple((t, len(found[t])) for t in targets)
    )


def rank_limit(model: nn.Module, plan: LoraPlan) -> tuple[int, str, tuple[int, int]]:
    """(largest useful rank, the layer that sets it, its weight's 2-d shape) over `plan`'s layers: the smallest
    min(in, out).

    A rank above min(in, out) adds adapter parameters and memory and no expressiveness: A @ B of a
    layer can never have a higher rank than that.
    """
    widths = []
    for name in plan.linears:
        module = model.get_submodule(name)
        widths.append((min(module.in_features, module.out_features), name, tuple(module.weight.shape)))
    for name, weights in plan.experts:
        module = model.get_submodule(name)
        for weight in weights:
            _, d1, d2 = getattr(module, weight).shape  # [E, in, out] or [E, out, in]: the smaller side bounds it
            widths.append((min(d1, d2), f"{name}.{weight}", (d1, d2)))
    return min(widths)


def check_plan(plan: LoraPlan, model: nn.Module, rank: int) -> None:
    """Refuse a target the model lacks (it would silently train nothing there), or a rank wider than a layer."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    missing = [t for t, count in plan.by_target if count == 0]
    if missing:
        why = "; ".join(f"{t!r}: {MISSING_HINTS[t]}" for t in missing)
        raise ConfigError(
            f"lora.targets {missing} match nothing in model_type {model_type!r} ({why}); drop them from lora.targets"
        )
    limit, layer, (d1, d2) = rank_limit(model, plan)
    if rank > limit:
        raise ConfigError(
            f"lora.rank {rank} is wider than the layers it adapts: {layer} has a {d1} x {d2} weight, and an adapter's "
            f"rank cannot exceed the smaller side (A @ B has rank <= {limit}; more only costs memory); "
            f"the largest allowed rank for lora.targets {list(dict(plan.by_target))} is {limit}: set lora.rank "
            f"to {limit} or less"
        )
