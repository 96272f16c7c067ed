"""Routing weights applied to the experts' rows before their down projection, instead of in the combine.

The down projection is linear and bias-free in the families this applies to, so
w * down(silu(gate) * up) = down(w * silu(gate) * up): the weight can scale the SwiGLU's output row (the fused
kernel does it in registers) and the combine becomes a plain sum of rows. The weighted combine has to save the
expert outputs y [N, D] and read them again in its backward for the weights' gradient (at Qwen3-30B-A3B's shapes,
8192 tokens x top-8 x 2048 bf16: 268 MB a layer kept and read); here that gradient is a sum over the SwiGLU row
[N, I] that its backward already reads, and y is freed after the combine.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.kernels.swiglu import swiglu_packed_weighted

# Shape suffixes: N routed rows, I the experts' intermediate width (I2: the packed gate and up halves).

# Experts backends whose forward runs the gate this module can weight (the TE path keeps the weighted combine).
BACKENDS_TAKING_ROW_WEIGHTS = ("grouped_mm", "loop")


def weights_fold_into_rows(layout, backend: str, plain_swiglu: bool) -> bool:
    """Whether an experts module of `layout` (hf_experts.ExpertsLayout) can take its routing weights in the SwiGLU.

    Decided once, at install. Only a plain SwiGLU gate (the fused weighted kernel's) with a bias-free down
    projection and no norm after it: a bias or a norm would be scaled with the weight, which the family's own
    forward does not do. The rows then take them where the dispatcher hands them out (its caps.rows_take_weights).
    """
    return (
        backend in BACKENDS_TAKING_ROW_WEIGHTS
        and plain_swiglu
        and not layout.has_bias
        and not layout.has_post_expert_norm
    )


def weighted_swiglu(module: nn.Module, h_NI2: torch.Tensor, row_weights_N: torch.Tensor) -> torch.Tensor:
    """w[n] * silu(gate) * up for the packed rows, with the module's SwiGLU backend."""
    return swiglu_packed_weighted(h_NI2, row_weights_N, backend=module.plan.swiglu)
