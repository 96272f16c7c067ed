"""Single-rank dispatch, and the permutation helpers every dispatcher shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Permutation:
    """Where each expert-major row came from: which token and which of its k slots."""

    token_of_row: torch.Tensor   # [N] source token index of each expert-major row
    slot_order: torch.Tensor     # [N] index into the flattened [T*K] (token, slot) pairs
    num_tokens: int


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[Permutation, torch.Tensor]:
    """Stable sort of (token, slot) pairs by expert id; counts per expert without a host sync."""
    num_tokens, top_k = topk_ids_TK.shape
    flat_ids = topk_ids_TK.reshape(-1)
    slot_order = torch.argsort(flat_ids, stable=True)
    tokens_per_expert = torch.zeros(num_experts, dtype=torch.int64, device=flat_ids.device)
    tokens_per_expert.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    perm = Permutation(token_of_row=slot_order // top_k, slot_order=slot_order, num_tokens=num_tokens)
    return perm, tokens_per_expert


def permute(x_TD: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Gather token rows into expert-major order."""
    return x_TD.index_select(0, perm.token_of_row)


def unpermute(y_ND: torch.Tensor, weights_TK: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """Scale rows by their routing weight and sum them back per token (accumulated in float32)."""
    weights_N = weights_TK.reshape(-1).index_select(0, perm.slot_order)
    weighted_ND = y_ND.float() * weights_N.float()[:, None]
    out_TD = weighted_ND.new_zeros(perm.num_tokens, y_ND.shape[1])
    out_TD.index_add_(0, perm.token_of_row, weighted_ND)
    return out_TD.to(y_ND.dtype)


@dataclass
class LocalHandle:
    perm: Permutation
    topk_weights_TK: torch.Tensor


class LocalDispatcher:
    """Single-rank dispatch: all experts are local, so dispatch is a permutation."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        perm, tokens_per_expert = sort_by_expert(topk_ids_TK, self.num_experts)
        return permute(x_TD, perm), tokens_per_expert, LocalHandle(perm, topk_weights_TK)

    def combine(self, y_by_expert_ND, handle: LocalHandle):
        return unpermute(y_by_expert_ND, handle.topk_weights_TK, handle.perm)
