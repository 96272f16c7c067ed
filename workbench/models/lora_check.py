"""The LoRA of a model config, checked on its meta model before any weight exists: the targets it names and its rank
(check_lora_targets), and the adapters' parameter counts (adapter_counts) the memory estimate reads."""

from __future__ import annotations

from workbench.models.lora_targets import LoraPlan, check_plan, plan_lora
from workbench.models.meta_model import meta_model


def check_lora_targets(config, lora) -> LoraPlan:
    """The plan of `lora` for `config`'s model, built on the meta device; refuses missing targets and a rank
    wider than a targeted layer (before any weight is allocated)."""
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
