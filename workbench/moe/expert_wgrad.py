"""The experts' grouped linear whose weight gradient comes with its sum of squares (BackendConfig.expert_wgrad).

With expert_wgrad='autograd' the experts' own backward computes the weight gradient (CUTLASS's grouped GEMM), and the
trainer's clipping norm reads it back: 1.2 GB a Qwen3-30B-A3B layer in bf16. With 'triton' the forward and the
input gradient stay torch's grouped GEMMs, and the weight gradient is kernels/grouped_wgrad.py's, whose tiles sum
their squares as they store; the sums are recorded on the weight (kernels/grad_squares.py) and the norm takes them
instead of the gradient's bytes, for as long as .grad is exactly that tensor.
"""

from __future__ import annotations

import torch

from workbench.kernels import grad_squares
from workbench.kernels.grouped_wgrad import grouped_wgrad, triton_takes
from workbench.moe.grouped_mm import grouped_mm_op, weight_EKO

# Shape suffixes: N expert-major rows, E experts, K the layer's input width, O its output width.

WGRAD_BACKENDS = ("autograd", "triton")


def wgrad_applies(x_NK: torch.Tensor, weight_E: torch.Tensor) -> bool:
    """Whether the Triton weight gradient takes this layer: a trained weight, operands its kernel tiles."""
    if not (weight_E.requires_grad and torch.is_grad_enabled()):
        return False
    m, n = weight_E.shape[-2:]  # the gradient has the weight's own layout, transposed or not
    return x_NK.dtype == weight_E.dtype and triton_takes(x_NK.dtype, x_NK.device, m, n)


def wgrad_refusal(weight_E: torch.Tensor) -> str | None:
    """Why the Triton weight gradient cannot take this weight's GEMMs (its tiles do not divide them), or None."""
    from workbench.kernels.triton_grouped_wgrad import blocks_for  # Triton: optional, imported where its kernel runs

    m, n = weight_E.shape[-2:]
    if blocks_for(m, n) is None:
        return f"its [{m}, {n}] gradient is not a whole number of 16 x 16 tiles"
    return None


class _GroupedLinearWgrad(torch.autograd.Function):
    """grouped_mm(x, w) with torch's forward and input gradient, the weight gradient from grouped_wgrad."""

    @staticmethod
    def forward(ctx, x_NK: torch.Tensor, weight_E: torch.Tensor, offsets_E: torch.Tensor, transposed: bool):
        ctx.save_for_backward(x_NK, weight_E, offsets_E)
        ctx.transposed = transposed
        ctx.weight = weight_E  # the leaf whose .grad autograd fills: the squares are recorded on it
        return grouped_mm_op()(x_NK, weight_EKO(weight_E, transposed), offs=offsets_E)

    @staticmethod
    def backward(ctx, dy_NO: torch.Tensor):
        x_NK, weight_E, offsets_E = ctx.saved_tensors
        dx_NK = dw_E = None
        if ctx.needs_input_grad[0]:
            dx_NK = grouped_mm_op()(dy_NO, weight_EKO(weight_E, ctx.transposed).transpose(-2, -1), offs=offsets_E)
        if ctx.needs_input_grad[1]:
            # untransposed [E, O, K]: w_e's gradient is dy_e^T x_e; transposed [E, K, O]: x_e^T dy_e
            a, b = (x_NK, dy_NO) if ctx.transposed else (dy_NO, x_NK)
            dw_E, partials = grouped_wgrad(a, b, offsets_E)
            grad_squares.record(ctx.weight, dw_E, partials)
        return dx_NK, dw_E, None, None


def grouped_linear_wgrad(
    x_NK: torch.Tensor, weight_E: torch.Tensor, offsets_E: torch.Tensor, transposed: bool
) -> torch.Tensor:
    """Rows of expert e times its weight (expert-major rows, int32 end offsets), for expert_wgrad='triton'."""
    return _GroupedLinearWgrad.apply(x_NK, weight_E, offsets_E, transposed)
