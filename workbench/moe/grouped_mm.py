"""torch's grouped GEMM as the experts call it: the op, and a fused expert weight in the layout it multiplies by."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Shape suffixes: E experts, K a layer's input width, O its output width.


def grouped_mm_op():
    """torch's grouped GEMM: the public name where this torch has it, else the private op."""
    return getattr(F, "grouped_mm", None) or torch._grouped_mm


def weight_EKO(weight_E: torch.Tensor, transposed: bool) -> torch.Tensor:
    """The [E, K, O] view grouped_mm multiplies [N, K] rows by (untransposed weights are stored [E, O, K])."""
    return weight_E if transposed else weight_E.transpose(-2, -1)
