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


def check_plan(plan: LoraPlan, model_type: str) -> None:
    """Refuse a target the model lacks (it would silently train nothing there)."""
    from workbench.config_checks import ConfigError

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


def check_lora_targets(config, lora) -> LoraPlan:
    """The plan of `lora` for `config`'s model, built on the meta device; refuses missing targets."""
    from workbench.models.generic import meta_model

    plan = plan_lora(meta_model(config), lora.targets)
    check_plan(plan, getattr(config, "model_type", None))
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
