"""Which modules and parameters of a Transformers MoE model each `lora.targets` entry names.

Found from the module tree, not per family: every decoder layer's attention projections (any
nn.Linear under `self_attn` / `linear_attn`: q/k/v/o, MLA's q_a/q_b/kv_a/kv_b), the fused
routed experts' up (gate+up) and down weights, the nn.Linears of shared experts, of dense layers'
MLPs, and the router's gate where it is an nn.Linear.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

ATTENTION_NAMES = ("self_attn", "linear_attn")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward")
SHARED_NAMES = ("shared_expert", "shared_experts", "shared_mlp")
ROUTER_NAMES = ("gate", "router")


@dataclass(frozen=True)
class LoraPlan:
    """The full names of what gets adapters: nn.Linear modules, and (experts module, parameter names)."""

    linears: tuple[str, ...]
    experts: tuple[tuple[str, tuple[str, ...]], ...]
    by_target: tuple[tuple[str, int], ...]  # (target, how many modules it matched)


def _linears_under(prefix: str, module: nn.Module) -> list[str]:
    return [f"{prefix}.{n}" for n, m in module.named_modules() if n and type(m) is nn.Linear]


def _layer_parts(layer: nn.Module):
    attn = [(n, getattr(layer, n)) for n in ATTENTION_NAMES if isinstance(getattr(layer, n, None), nn.Module)]
    mlp = next(((n, getattr(layer, n)) for n in MLP_NAMES if isinstance(getattr(layer, n, None), nn.Module)), None)
    return attn, mlp


def plan_lora(model: nn.Module, targets: tuple[str, ...]) -> LoraPlan:
    """What each of `targets` names in `model` (vanilla or with the engine installed)."""
    from workbench.moe.hf_experts import is_fused_experts, layout_of
    from workbench.parallel.fsdp import decoder_layers

    layer_names = {id(m): n for n, m in model.named_modules()}
    found: dict[str, list] = {t: [] for t in targets}
    for layer in decoder_layers(model):
        name = layer_names[id(layer)]
        attn, mlp = _layer_parts(layer)
        if "attention" in found:
            for attn_name, module in attn:
                found["attention"] += _linears_under(f"{name}.{attn_name}", module)
        if mlp is None:
            continue
        mlp_name, mlp_module = mlp
        experts = [(n, m) for n, m in mlp_module.named_modules() if is_fused_experts(m)]
        if not experts:
            if "dense_mlp" in found:
                found["dense_mlp"] += _linears_under(f"{name}.{mlp_name}", mlp_module)
            continue
        if "experts" in found:
            for n, m in experts:
                layout = layout_of(m)
                found["experts"].append((f"{name}.{mlp_name}.{n}", (layout.up_name, "down_proj")))
        for child_name, child in mlp_module.named_children():
            full = f"{name}.{mlp_name}.{child_name}"
            if "shared_experts" in found and child_name in SHARED_NAMES:
                found["shared_experts"] += _linears_under(full, child)
            if "router" in found and child_name in ROUTER_NAMES and type(child) is nn.Linear:
                found["router"].append(full)
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
    from workbench.config_checks import ConfigError

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    missing = [t for t, count in plan.by_target if count == 0]
    if missing:
        hints = {
            "router": "its router is not an nn.Linear",
            "dense_mlp": "it has no dense (non-MoE) layers",
            "shared_experts": "it has no shared experts",
            "experts": "it has no fused experts modules",
            "attention": "no nn.Linear under self_attn/linear_attn",
        }
        why = "; ".join(f"{t!r}: {hints[t]}" for t in missing)
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


def check_lora_targets(config, lora) -> LoraPlan:
    """The plan of `lora` for `config`'s model, built on the meta device; refuses missing targets and a rank
    wider than a targeted layer (before any weight is allocated)."""
    from workbench.models.generic import meta_model

    model = meta_model(config)
    plan = plan_lora(model, lora.targets)
    check_plan(plan, model, lora.rank)
    return plan


def adapter_counts(config, lora) -> tuple[int, int, int]:
    """(dense adapter parameters, routed-expert adapter parameters, adapted modules per token path) of `lora`.

    Counted on the meta model: r * (in + out) per nn.Linear, E * r * (in + out) per fused expert weight.
    The third number is how many adapters one token passes through (each routed copy counted once per
    expert weight), for the rank-wide activations they keep.
    """
    from workbench.models.generic import meta_model

    model = meta_model(config)
    plan = plan_lora(model, lora.targets)
    dense = sum(lora.rank * (m.in_features + m.out_features) for m in map(model.get_submodule, plan.linears))
    experts = 0
    top_k = getattr(config, "num_experts_per_tok", None) or 1
    for name, weights in plan.experts:
        module = model.get_submodule(name)
        for w in weights:
            e, d1, d2 = getattr(module, w).shape
            experts += e * lora.rank * (d1 + d2)
    return dense, experts, len(plan.linears) + top_k * sum(len(w) for _, w in plan.experts)
