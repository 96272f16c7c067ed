"""The input embedding with the engine's gradient kernel: a class swap of the model's plain nn.Embedding table.

The lookup and the parameter stay nn.Embedding's (same state dict); only where the table's gradient comes from
changes, by BackendConfig.embedding (kernels/embedding.py).
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.kernels.embedding import EMBEDDING_BACKENDS


def is_plain_embedding(module: nn.Module) -> bool:
    """An nn.Embedding that is a plain lookup: no max_norm renormalization, frequency scaling or sparse gradient."""
    return (
        isinstance(module, nn.Embedding)
        and module.max_norm is None
        and not module.scale_grad_by_freq
        and not module.sparse
    )


class EngineEmbedding(nn.Embedding):
    """nn.Embedding whose lookup runs the backend `gradient_backend` (same parameter, same state dict)."""

    gradient_backend: str = "torch"  # the resolved BackendConfig.embedding, set by use_engine_embeddings

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """The lookup, with the chosen backend's gradient."""
        return EMBEDDING_BACKENDS.impl(self.gradient_backend)(ids, self.weight, self.padding_idx)


def use_engine_embeddings(model: nn.Module, backend: str) -> int:
    """`model`'s input embedding computes its gradient with `backend` (a class swap; 'torch': none); 1 if swapped."""
    table = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if backend == "torch" or type(table) is not nn.Embedding or not is_plain_embedding(table):
        return 0
    table.__class__ = EngineEmbedding
    table.gradient_backend = backend
    return 1
