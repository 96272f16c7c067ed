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

from workbench.config_checks import ConfigError
from workbench.models.engine_state import engine_state
from workbench.models.lora_targets import LoraPlan, check_plan, plan_lora
from workbench.moe.lora_experts import add_expert_adapters

# Shape suffixes: T tokens, I in features, O out features, R LoRA rank.


class _LoraLinearFunction(torch.autograd.Function):
    """x W^T + b + s (x A^T) B^T as 3 GEMMs forward and at most 5 backward, each with the scaling as its alpha.

    Autograd over linear + linear + addmm launches about twice the kernels, scalar multiplies and views
    for the same GEMMs (LoRA steps are launch-bound: each op is host time), and a separate add for the
    input's two gradients. Weights that need no gradient (the frozen base) get none computed.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling: float):
        x_TI = x.reshape(-1, x.shape[-1])
        xa_TR = x_TI @ lora_a.t()
        out_TO = torch.addmm(bias, x_TI, weight.t()) if bias is not None else x_TI @ weight.t()
        out_TO.addmm_(xa_TR, lora_b.t(), alpha=scaling)  # B's GEMM accumulates onto the base output
        ctx.save_for_backward(x_TI, weight, lora_a, lora_b, xa_TR)
        ctx.scaling, ctx.x_shape, ctx.has_bias = scaling, x.shape, bias is not None
        return out_TO.view(*x.shape[:-1], out_TO.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        x_TI, weight, lora_a, lora_b, xa_TR = ctx.saved_tensors
        need_x, need_w, need_b, need_a, need_lb = ctx.needs_input_grad[:5]
        g_TO = grad_out.reshape(-1, grad_out.shape[-1])
        s = ctx.scaling
        grad_x = grad_w = grad_bias = grad_a = grad_lb = None
        g_xa_TR = None
        if need_x or need_a:
            g_xa_TR = torch.addmm(xa_TR, g_TO, lora_b, beta=0, alpha=s)  # s * g B (beta 0: xa only gives the shape)
        if need_lb:
            grad_lb = torch.addmm(lora_b, g_TO.t(), xa_TR, beta=0, alpha=s)
        if need_a:
            grad_a = g_xa_TR.t() @ x_TI
        if need_x:
            grad_x = (g_TO @ weight).addmm_(g_xa_TR, lora_a).view(ctx.x_shape)
        if need_w:
            grad_w = g_TO.t() @ x_TI
        if need_b and ctx.has_bias:
            grad_bias = g_TO.sum(0)
        return grad_x, grad_w, grad_bias, grad_a, grad_lb, None


class LoraLinear(nn.Linear):
    """nn.Linear plus a low-rank update: x W^T + b + scaling * B(A(dropout(x)))."""

    lora_scaling: float = 1.0
    lora_dropout_p: float = 0.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The base projection plus the adapter's."""
        if not (self.lora_dropout_p and self.training):
            return _LoraLinearFunction.apply(
                x, self.weight, self.bias, self.lora_A.weight, self.lora_B.weight, self.lora_scaling
            )
        # With dropout the adapter sees another input than the base: autograd over the plain ops
        base = F.linear(x, self.weight, self.bias)
        xa = self.lora_A(F.dropout(x, self.lora_dropout_p, self.training))
        out = torch.addmm(
            base.reshape(-1, base.shape[-1]),
            xa.reshape(-1, xa.shape[-1]),
            self.lora_B.weight.t(),
            alpha=self.lora_scaling,
        )
        return out.view(base.shape)


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
    backend = engine_state(model).backend
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
    check_plan(plan, model, lora.rank)
    _check_backend(model, plan)
    for param in model.parameters():
        param.requires_grad_(False)
    for name in plan.linears:
        _to_lora_linear(model.get_submodule(name), name, lora.rank, lora.scaling, lora.dropout, seed)
    for name, weights in plan.experts:
        add_expert_adapters(model.get_submodule(name), name, weights, lora.rank, lora.scaling, lora.dropout, seed)
    state = engine_state(model)
    state.lora, state.lora_plan = lora, plan
    return plan


def is_adapter_name(name: str) -> bool:
    """Whether a parameter / state-dict name is a LoRA adapter's."""
    leaf = name.rsplit(".", 2)
    return ".lora_A." in name or ".lora_B." in name or leaf[-1].endswith(("_lora_A", "_lora_B"))


def adapter_parameters(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) of every adapter of `model`, in module order."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_name(n)]
