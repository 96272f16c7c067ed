"""LoRA in the engine: frozen base weights, trainable low-rank adapters on `lora.targets`.

nn.Linear targets (attention, shared experts, dense MLPs, router) become `LoraLinear`: the same
module (its `weight`/`bias` names unchanged) with `lora_A` [r, in] and `lora_B` [out, r] children,
PEFT's own names and shapes. The routed experts get grouped adapters (workbench.moe.lora_experts).
Applied after the base weights are loaded or initialized and before the model is cast and sharded,
so FSDP2 shards the adapters with their layer and expert parallelism slices them like the experts.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from workbench.models.lora_targets import LoraPlan, check_plan, plan_lora
from workbench.moe.lora_experts import add_expert_adapters


class LoraLinear(nn.Linear):
    """nn.Linear plus a low-rank update: x W^T + b + scaling * B(A(dropout(x)))."""

    lora_scaling: float = 1.0
    lora_dropout_p: float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base projection plus the adapter's."""
        base = F.linear(x, self.weight, self.bias)
        x = F.dropout(x, self.lora_dropout_p, self.training) if self.lora_dropout_p else x
        # B's GEMM accumulates onto the base output with the scaling as its alpha (addmm's float32 epilogue):
        # two passes over [tokens, out] fewer than PEFT's B(A(x)) * scaling + base, and no separate multiply
        # (LoRA steps are launch-bound: each op is host time)
        xa = self.lora_A(x)
        out = torch.addmm(
            base.reshape(-1, base.shape[-1]),
            xa.reshape(-1, xa.shape[-1]),
            self.lora_B.weight.t(),
            alpha=self.lora_scaling,
        )
        return out.view(base.shape)

    def delta_weight(self) -> torch.Tensor:
        """scaling * B @ A: what merging adds to `weight`."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.lora_scaling


def _to_lora_linear(module: nn.Linear, name: str, rank: int, scaling: float, dropout: float, seed: int) -> None:
    weight = module.weight
    a = nn.Linear(module.in_features, rank, bias=False, device=weight.device, dtype=weight.dtype)
    b = nn.Linear(rank, module.out_features, bias=False, device=weight.device, dtype=weight.dtype)
    bound = 1.0 / math.sqrt(module.in_features)  # PEFT's kaiming_uniform(a=sqrt(5)) on [r, in]
    g = torch.Generator(device=weight.device).manual_seed(zlib.crc32(f"{seed}/{name}/lora_A".encode()))
    with torch.no_grad():
        # Drawn in float32 whatever the base's dtype (a build casts before or after adding adapters)
        draw = torch.empty(a.weight.shape, device=weight.device, dtype=torch.float32)
        a.weight.copy_(draw.uniform_(-bound, bound, generator=g))
        b.weight.zero_()
    module.__class__ = LoraLinear
    module.lora_A, module.lora_B = a, b
    module.lora_scaling, module.lora_dropout_p = scaling, dropout


def _check_backend(model: nn.Module, plan: LoraPlan) -> None:
    from workbench.config_checks import ConfigError

    backend = getattr(model, "workbench_backend", None)
    if plan.linears and backend is not None and getattr(backend, "linear", "torch") == "te":
        raise ConfigError(
            "LoRA adapts torch nn.Linear projections; backend.linear='te' swapped them for TE "
            "Linears: set backend.linear='torch' (or keep only 'experts' in lora.targets)"
        )
    if plan.experts and backend is not None and backend.experts == "te":
        raise ConfigError(
            "LoRA on experts runs in the grouped_mm / loop expert paths; backend.experts='te' has "
            "no adapters: set backend.experts='grouped_mm' or drop 'experts' from lora.targets"
        )


def apply_lora(model: nn.Module, lora, seed: int = 0) -> LoraPlan:
    """Freeze every base parameter of `model` and add `lora`'s (a config.LoraConfig) adapters; in place.

    Adapters are seeded by (seed, module name[, expert id]), so they are the same on any mesh.
    """
    plan = plan_lora(model, lora.targets)
    check_plan(plan, getattr(model.config, "model_type", None))
    _check_backend(model, plan)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in plan.linears:
        _to_lora_linear(model.get_submodule(name), name, lora.rank, lora.scaling, lora.dropout, seed)
    for name, weights in plan.experts:
        add_expert_adapters(model.get_submodule(name), name, weights, lora.rank, lora.scaling, lora.dropout, seed)
    model.workbench_lora = lora
    model.workbench_lora_plan = plan
    return plan


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter's."""
    leaf = name.rsplit(".", 2)
    return ".lora_A." in name or ".lora_B." in name or leaf[-1].endswith(("_lora_A", "_lora_B"))


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter of `model`, in module order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_name(n)]
