"""LoRA on the fused routed experts: grouped low-rank GEMMs beside the base grouped GEMM.

Per fused weight W (`gate_up_proj` / `up_proj`, `down_proj`) of an engine experts module, two
adapters live on the module itself: A `[E, in, r]` and B `[E, r, out]` (B zero-initialized), named
`<weight>_lora_A` / `<weight>_lora_B`. The rows of expert e get `scaling * (x @ A[e]) @ B[e]` added to
their `x @ W[e]`: the same expert-major rows and tokens_per_expert as the base GEMM, no per-expert
weight W + A @ B is ever formed. The update is on the fused output columns, so a family's layout
(concatenated or interleaved gate/up, biases added after) is the base weight's own. Under expert
parallelism the adapters hold the same experts [first, last) as the base weights and are sharded
with them (FSDP2 over the expert-data-parallel dim, grad norm summed over ep).
"""

from __future__ import annotations

import dataclasses
import math
import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from workbench.moe.grouped_linear import grouped_linear

# Shape suffixes: N routed rows, D in features, R LoRA rank, E experts.


@dataclass(frozen=True)
class ExpertsLora:
    """The adapters of one engine experts module (its plan's `lora`): which fused weights, rank, scaling, dropout."""

    weights: tuple[str, ...]
    rank: int
    scaling: float
    dropout: float


def adapter_names(weight: str) -> tuple[str, str]:
    """The (A, B) parameter names of the adapters of fused weight `weight`."""
    return f"{weight}_lora_A", f"{weight}_lora_B"


def in_out(module: nn.Module, weight: str) -> tuple[int, int]:
    """(in, out) features of fused weight `weight`: stored [E, in, out] if transposed, else [E, out, in]."""
    shape = getattr(module, weight).shape
    return (shape[1], shape[2]) if module.plan.layout.is_transposed else (shape[2], shape[1])


def add_expert_adapters(
    module: nn.Module, name: str, weights: tuple[str, ...], rank: int, scaling: float, dropout: float, seed: int
) -> list[str]:
    """Give engine experts module `module` (full name `name`) adapters on `weights`; return their names.

    Each expert's A is seeded by (seed, module, weight, global expert id): the adapters do not
    depend on how the experts are split over ranks. A is PEFT's default (kaiming-uniform, bound
    1/sqrt(in)); B is zero, so the model starts equal to the base.
    """
    first, last = module.plan.expert_range
    base = getattr(module, weights[0])
    added = []
    for weight in weights:
        fan_in, fan_out = in_out(module, weight)
        # Drawn in float32 whatever the base's dtype (a build casts before or after adding adapters)
        a = torch.empty(last - first, fan_in, rank, device=base.device, dtype=torch.float32)
        bound = 1.0 / math.sqrt(fan_in)
        with torch.no_grad():
            for local, e in enumerate(range(first, last)):
                g = torch.Generator(device=base.device).manual_seed(
                    zlib.crc32(f"{seed}/{name}/{weight}/lora_A/{e}".encode())
                )
                a[local].uniform_(-bound, bound, generator=g)
        a = a.to(base.dtype)
        b = torch.zeros(last - first, rank, fan_out, device=base.device, dtype=base.dtype)
        name_a, name_b = adapter_names(weight)
        setattr(module, name_a, nn.Parameter(a))
        setattr(module, name_b, nn.Parameter(b))
        added += [name_a, name_b]
    module.plan = dataclasses.replace(module.plan, lora=ExpertsLora(tuple(weights), rank, scaling, dropout))
    return added


def lora_rows(
    module: nn.Module,
    weight: str,
    x_ND: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    offsets: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """scaling * (x @ A[e]) @ B[e] for expert-major rows, or None where `weight` has no adapters.

    The scaling multiplies the rank-r rows [N, r], not the output [N, out] (a pass over 1/100 of the
    bytes; exact for the usual alpha = 2 x rank, a power of two). `offsets`: the base GEMM's row offsets.
    """
    lora: ExpertsLora | None = module.plan.lora
    if lora is None or weight not in lora.weights:
        return None
    name_a, name_b = adapter_names(weight)
    if lora.dropout:
        x_ND = F.dropout(x_ND, lora.dropout, module.training)
    # A is [E, in, r] and B [E, r, out]: the transposed ([E, K, N]) layout grouped_mm takes as it is.
    xa_NR = grouped_linear(x_ND, tokens_per_expert, getattr(module, name_a), True, dtypes, offsets)
    return grouped_linear(xa_NR * lora.scaling, tokens_per_expert, getattr(module, name_b), True, dtypes, offsets)


def expert_delta(module: nn.Module, weight: str, a_E: torch.Tensor, b_E: torch.Tensor) -> torch.Tensor:
    """The update of fused weight `weight` in its stored layout: scaling * A @ B (transposed if [E, out, in])."""
    plan = module.plan
    delta = torch.bmm(a_E, b_E) * plan.lora.scaling  # [E, in, out]
    return delta if plan.layout.is_transposed else delta.transpose(1, 2)
