"""The token embedding's lookup, with its gradient from torch or from the Triton kernel that sums its squares.

`embedding` is F.embedding for the forward either way; backend 'triton' computes the table's gradient in
kernels/triton_embedding.py and records its sum of squares on the table (kernels/grad_squares.py), so the clipping
norm does not read the [V, D] gradient back while `.grad` is that very tensor.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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


def is_plain_embedding(module: nn.Module) -> bool:
    """An nn.Embedding that is a plain lookup: no max_norm renormalization, frequency scaling or sparse gradient."""
    return (
        isinstance(module, nn.Embedding)
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    )


class EngineEmbedding(nn.Embedding):
    """nn.Embedding whose lookup runs the backend in `workbench_embedding` (same parameter, same state dict)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The lookup, with the chosen backend's gradient."""
        return EMBEDDING_BACKENDS.impl(self.workbench_embedding)(ids, self.weight, self.padding_idx)


def use_engine_embeddings(model: nn.Module, backend: str) -> int:
    """`model`'s input embedding computes its gradient with `backend` (a class swap; 'torch': none); 1 if swapped."""
    table = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if backend == "torch" or type(table) is not nn.Embedding or not is_plain_embedding(table):
        return 0
    table.__class__ = EngineEmbedding
    table.workbench_embedding = backend
    return 1
