"""The token embedding's lookup, with its gradient from torch or from the Triton kernel that sums its squares.

`embedding` is F.embedding for the forward either way; backend 'triton' computes the table's gradient in
kernels/triton_embedding.py and records its sum of squares on the table (kernels/grad_squares.py), so the clipping
norm does not read the [V, D] gradient back while `.grad` is that very tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.kernels import grad_squares
from workbench.kernels.registry import KernelRegistry

# Shape suffixes: V table rows, D the embedding width.


class _EmbeddingWithSquares(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight_VD: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight_VD  # the leaf whose .grad autograd fills: the squares are recorded on it
        ctx.padding_idx = padding_idx
        return F.embedding(ids, weight_VD, padding_idx)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Triton: optional, imported where its kernel runs
        from workbench.kernels.triton_embedding import embedding_backward

        if not ctx.needs_input_grad[1]:
            return None, None, None
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        grad_VD, partials_V = embedding_backward(grad.to(weight.dtype), ids, weight.shape[0], ctx.padding_idx)
        grad_squares.record(weight, grad_VD, partials_V)
        return None, grad_VD, None


def embedding_torch(ids: torch.Tensor, weight_VD: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """F.embedding: torch's lookup and its own backward."""
    return F.embedding(ids, weight_VD, padding_idx)


def embedding_triton(ids: torch.Tensor, weight_VD: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
    """F.embedding whose table gradient is the Triton kernel's, its sum of squares recorded for the norm."""
    if not (weight_VD.requires_grad and torch.is_grad_enabled()):
        return F.embedding(ids, weight_VD, padding_idx)
    return _EmbeddingWithSquares.apply(ids, weight_VD, padding_idx)


EMBEDDING_BACKENDS = KernelRegistry("embedding", {"torch": embedding_torch, "triton": embedding_triton})
