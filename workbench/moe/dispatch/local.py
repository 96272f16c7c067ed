"""Single-rank dispatch, and the permutation helpers every dispatcher shares."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.kernels.sorting import counts_of_sorted, stable_sort
from workbench.moe.dispatch.contract import DispatcherCaps

# Shape suffixes: T tokens, D hidden, K top-k, N routed rows (T x K, expert-major), 1 a size-1 dim.


@dataclass
class Permutation:
    """Where each expert-major row came from: which token and which of its k slots."""

    token_of_row: torch.Tensor  # [N] source token index of each expert-major row
    slot_order: torch.Tensor  # [N] flattened (token, slot) index of each expert-major row
    row_of_slot: torch.Tensor  # [N] the inverse: expert-major row of each (token, slot)
    num_tokens: int
    top_k: int


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """inv such that inv[order[i]] = i."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inverse


def sort_by_expert(topk_ids_TK: torch.Tensor, num_experts: int) -> tuple[Permutation, torch.Tensor]:
    """Stable sort of (token, slot) pairs by expert id; counts per expert without a host sync."""
    num_tokens, top_k = topk_ids_TK.shape
    flat_ids = topk_ids_TK.reshape(-1)
    sorted_ids, slot_order = stable_sort(flat_ids, num_experts - 1)
    tokens_per_expert = counts_of_sorted(sorted_ids, num_experts)
    perm = Permutation(
        token_of_row=slot_order // top_k,
        slot_order=slot_order,
        row_of_slot=inverse_permutation(slot_order),
        num_tokens=num_tokens,
        top_k=top_k,
    )
    return perm, tokens_per_expert


# Both directions are written as gathers. index_select's own backward is an index_add (atomic
# scatter-adds), which the profile of a 16-layer Qwen3-30B-A3B step on H200 showed costing
# ~140 ms of a 490 ms step; a gather by the inverse permutation does the same work without atomics.


class GatherRows(torch.autograd.Function):
    """out = x[order] for a permutation `order`; the gradient is gathered back with its inverse."""

    @staticmethod
    def forward(ctx, x_ND, order, inverse):
        ctx.save_for_backward(inverse)
        return x_ND.index_select(0, order)

    @staticmethod
    def backward(ctx, grad_ND):
        (inverse,) = ctx.saved_tensors
        return grad_ND.index_select(0, inverse), None, None


def gather_slots(y_ND: torch.Tensor, row_of_slot: torch.Tensor) -> torch.Tensor:
    """y[row_of_slot], where the index N (= y's row count) reads a zero row.

    A slot has no row when its expert lives on another rank (dispatchers that send a token once
    per rank). Every row belongs to exactly one slot, so there are such slots exactly when the
    slots outnumber the rows.
    """
    if row_of_slot.numel() != y_ND.shape[0]:
        y_ND = torch.cat([y_ND, y_ND.new_zeros(1, y_ND.shape[1])])
    return y_ND.index_select(0, row_of_slot)


class _ExpandToExperts(torch.autograd.Function):
    """Copy each token to its expert-major rows; the gradient sums each token's rows.

    `row_of_slot` [T*K] may mark slots without a row (see gather_slots). `use_triton`: the
    backward is the Triton combine kernel (BackendConfig.combine='triton').
    """

    @staticmethod
    def forward(ctx, x_TD, token_of_row, row_of_slot, top_k, use_triton):
        ctx.save_for_backward(row_of_slot)
        ctx.top_k = top_k
        ctx.use_triton = use_triton
        return x_TD.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad_ND):
        (row_of_slot,) = ctx.saved_tensors
        return sum_slots(grad_ND, row_of_slot, ctx.top_k, ctx.use_triton), None, None, None, None


def sum_slots(
    y_ND: torch.Tensor,
    row_of_slot: torch.Tensor,
    top_k: int,
    use_triton: bool,
    residual_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k y[row_of_slot[t*K + k]] (+ residual[t]), summed in float32; slots may have no row."""
    if use_triton:  # the unweighted combine: one pass over the rows, no [T, K, D] gather
        from workbench.kernels.triton_combine import sum_forward  # Triton: optional, imported where its kernel runs

        return sum_forward(y_ND, row_of_slot, top_k, residual_TD)
    y_TKD = gather_slots(y_ND, row_of_slot).view(row_of_slot.numel() // top_k, top_k, y_ND.shape[-1])
    if residual_TD is None:
        return y_TKD.sum(dim=1)  # torch sums bf16 in float32 and rounds once
    return (y_TKD.sum(dim=1, dtype=torch.float32) + residual_TD.float()).to(y_ND.dtype)


class _SumRows(torch.autograd.Function):
    """out[t] = sum of t's expert rows (+ residual[t]): the combine of rows that carry their routing weights.

    The transpose of _ExpandToExperts: its backward copies each token's gradient to its rows and saves no rows
    (the weighted combine saves y, [N, D], and reads it again for the weights' gradient).
    """

    @staticmethod
    def forward(ctx, y_ND, token_of_row, row_of_slot, top_k, use_triton, residual_TD=None):
        ctx.save_for_backward(token_of_row)
        return sum_slots(y_ND, row_of_slot, top_k, use_triton, residual_TD)

    @staticmethod
    def backward(ctx, grad_TD):
        (token_of_row,) = ctx.saved_tensors
        grad_y = grad_TD.index_select(0, token_of_row) if ctx.needs_input_grad[0] else None
        return grad_y, None, None, None, None, grad_TD if ctx.needs_input_grad[5] else None


def permute(x_TD: torch.Tensor, perm: Permutation, use_triton: bool = False) -> torch.Tensor:
    """Gather token rows into expert-major order (k copies of each token)."""
    return expand_to_rows(x_TD, perm.token_of_row, perm.row_of_slot, perm.top_k, use_triton)


def expand_to_rows(
    x_TD: torch.Tensor, token_of_row: torch.Tensor, row_of_slot: torch.Tensor, top_k: int, use_triton: bool = False
) -> torch.Tensor:
    """x[token_of_row] with a gather-sum backward; `row_of_slot` may mark slots without a row."""
    return _ExpandToExperts.apply(x_TD, token_of_row, row_of_slot, top_k, use_triton)


def combine_uses_triton(combine: str) -> bool:
    """Whether a dispatcher built with BackendConfig.combine=`combine` runs the Triton kernels."""
    if combine not in ("torch", "triton"):
        raise ValueError(f"combine must be a resolved BackendConfig.combine, 'torch' or 'triton'; got {combine!r}")
    return combine == "triton"


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum_k w[t, k] * y[row(t, k)], in float32, saving only y's own bf16 rows.

    A slot without a row (see gather_slots) adds nothing and gets a zero weight gradient.

    Autograd through `bmm(w.float(), y[rows].float())` saved the float32 copy of the gathered
    rows, [T, K, D] x 4 bytes: 537 MB per MoE layer at 8k tokens x top-8 x 2048, twice y's size.
    Here the backward gathers y again (bf16) for the routing-weight gradient instead. On CUDA the
    fused Triton kernels (kernels/triton_combine.py) replace the gathers, copies and gemvs.
    """

    @staticmethod
    def forward(ctx, y_ND, weights_TK, row_of_slot, slot_order, use_triton, residual_TD=None):
        num_tokens, top_k = weights_TK.shape
        ctx.save_for_backward(y_ND, weights_TK, row_of_slot, slot_order)
        ctx.use_triton = use_triton
        if ctx.use_triton:
            # Triton: optional, imported where its kernel runs
            from workbench.kernels.triton_combine import combine_forward

            return combine_forward(y_ND, weights_TK, row_of_slot, residual_TD=residual_TD)
        # Widths spelled out: a rank can receive no tokens at all (view(0, k, -1) is ambiguous).
        y_TKD = gather_slots(y_ND, row_of_slot).view(num_tokens, top_k, y_ND.shape[-1])
        # bmm into a [T, D] tensor of its own: `bmm(...).squeeze(1)` is a view, and in float32 (where `.to` below
        # copies nothing) the MoE block would return it, which FSDP2 warns about on every rank.
        out_TD = torch.empty(num_tokens, y_ND.shape[-1], dtype=torch.float32, device=y_ND.device)
        torch.bmm(weights_TK.float().unsqueeze(1), y_TKD.float(), out=out_TD.view(num_tokens, 1, y_ND.shape[-1]))
        if residual_TD is not None:
            out_TD = out_TD + residual_TD.float()
        return out_TD.to(y_ND.dtype)

    @staticmethod
    def backward(ctx, grad_TD):
        y_ND, weights_TK, row_of_slot, slot_order = ctx.saved_tensors
        num_tokens, top_k = weights_TK.shape
        if ctx.use_triton:
            # Triton: optional, imported where its kernel runs
            from workbench.kernels.triton_combine import combine_backward

            grad_y, grad_w = combine_backward(grad_TD, y_ND, weights_TK, row_of_slot)
            return grad_y, grad_w, None, None, None, grad_TD if ctx.needs_input_grad[5] else None
        grad_T1D = grad_TD.float().unsqueeze(1)
        grad_y = grad_w = None
        if ctx.needs_input_grad[1]:
            y_TKD = gather_slots(y_ND, row_of_slot).view(num_tokens, top_k, y_ND.shape[-1])
            grad_w = torch.bmm(y_TKD.float(), grad_T1D.transpose(1, 2)).squeeze(2).to(weights_TK.dtype)
        if ctx.needs_input_grad[0]:
            grad_TKD = (weights_TK.float().unsqueeze(2) * grad_T1D).to(y_ND.dtype)
            # row r of y came from slot slot_order[r]
            grad_y = grad_TKD.view(num_tokens * top_k, grad_TKD.shape[-1]).index_select(0, slot_order)
        # the residual's gradient is the output's own (a residual stream adds, nothing scales it)
        return grad_y, grad_w, None, None, None, grad_TD if ctx.needs_input_grad[5] else None


def weighted_sum(
    y_ND: torch.Tensor,
    weights_TK: torch.Tensor,
    row_of_slot: torch.Tensor,
    slot_of_row: torch.Tensor,
    use_triton: bool = False,
    residual_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[row_of_slot[t*K + k]] (+ residual[t]) in float32; slots may have no row."""
    return _WeightedCombine.apply(y_ND, weights_TK, row_of_slot, slot_of_row, use_triton, residual_TD)


def unpermute(
    y_ND: torch.Tensor,
    weights_TK: torch.Tensor,
    perm: Permutation,
    use_triton: bool = False,
    residual_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each token's weighted sum of its k expert rows (a gather, then a [1,K] x [K,D] product), plus `residual_TD`.

    In float32: the routing weights' gradient feeds the softmax's, a difference of near-equal
    terms, and a bf16 product there tripled the router-side gradient error in bf16 parity tests.
    """
    if weights_TK.shape != (perm.num_tokens, perm.top_k):
        raise ValueError(
            f"routing weights {tuple(weights_TK.shape)} do not match the permutation's "
            f"({perm.num_tokens}, {perm.top_k})"
        )
    return weighted_sum(y_ND, weights_TK, perm.row_of_slot, perm.slot_order, use_triton, residual_TD)


def row_weights(weights_TK: torch.Tensor, perm: Permutation) -> torch.Tensor:
    """The routing weight of each expert-major row [N] (differentiable: the gradient goes back to its slot)."""
    return GatherRows.apply(weights_TK.reshape(-1), perm.slot_order, perm.row_of_slot)


@dataclass
class LocalHandle:
    perm: Permutation
    topk_weights_TK: torch.Tensor


class LocalDispatcher:
    """Single-rank dispatch: all experts are local, so dispatch is a permutation.

    Its caps: dispatch's tokens_per_expert counts every expert's (token, slot) pairs (the routed-load counter reuses
    them); row_weights gives the rows' routing weights to experts that apply them (moe/row_weights.py), and
    combine(weighted=False) then sums the rows; combine adds a residual stream in its sum (the fused decoder
    layer of models/families/qwen3_moe/decoder.py).
    """

    caps = DispatcherCaps(counts_every_expert=True, rows_take_weights=True, combine_adds_residual=True)

    def __init__(self, num_experts: int, combine: str = "torch"):
        self.num_experts = num_experts
        self.use_triton = combine_uses_triton(combine)

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        perm, tokens_per_expert = sort_by_expert(topk_ids_TK, self.num_experts)
        return permute(x_TD, perm, self.use_triton), tokens_per_expert, LocalHandle(perm, topk_weights_TK)

    def row_weights(self, handle: LocalHandle) -> torch.Tensor:
        """The routing weight of each dispatched row, in the rows' order."""
        return row_weights(handle.topk_weights_TK, handle.perm)

    def combine(
        self,
        y_by_expert_ND,
        handle: LocalHandle,
        residual_TD: torch.Tensor | None = None,
        weighted: bool = True,
    ):
        if not weighted:
            perm = handle.perm
            return _SumRows.apply(
                y_by_expert_ND, perm.token_of_row, perm.row_of_slot, perm.top_k, self.use_triton, residual_TD
            )
        return unpermute(y_by_expert_ND, handle.topk_weights_TK, handle.perm, self.use_triton, residual_TD)
