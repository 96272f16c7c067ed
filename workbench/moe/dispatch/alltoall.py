"""Expert-parallel dispatch over torch.distributed all-to-all (NCCL on GPUs, gloo on CPU).

Each token travels once to every ep rank that owns at least one of its experts, not once per
expert: with top-8 over 128 experts on 2 ranks a token almost always has experts on both, so 2
rows leave per token instead of 8 (4x fewer bytes; on 8 ranks ~5.3 instead of 8). The routing
weights and local expert ids of the slots on that rank travel with the row. The receiving rank
expands the row to its experts, weights and sums its experts' outputs per token (float32 sums),
and sends one partial row back; home adds the partial rows (float32). Splits are uneven, with
no padding, through autograd-aware collectives; one host sync per layer reads the split sizes,
which the collectives need on the host.

Rows reach the experts in (local expert, source rank, source token) order, as DeepEP's do.
Against a per-expert exchange, results differ by one bf16 rounding of each per-rank partial sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from workbench.kernels.sorting import stable_order
from workbench.moe.dispatch.contract import NO_CAPS
from workbench.moe.dispatch.local import combine_uses_triton, expand_to_rows, weighted_sum

# Shape suffixes: T tokens, D hidden, K top-k, P ep ranks, S rows sent, R rows received, N routed rows.


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)
    return wait_tensor(out)


def rank_counts(topk_ids_TK: torch.Tensor, ep_size: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Which ep ranks each token goes to [T, P], and per destination rank (rows, slots) [P, 2]."""
    T, K = topk_ids_TK.shape
    device = topk_ids_TK.device
    rank_TK = topk_ids_TK // num_local
    in_rank_TP = torch.zeros(T, ep_size, dtype=torch.bool, device=device).scatter_(1, rank_TK, True)
    slots_to_P = torch.zeros(ep_size, dtype=torch.int64, device=device).scatter_add_(
        0, rank_TK.reshape(-1), torch.ones(T * K, dtype=torch.int64, device=device)
    )
    return in_rank_TP, torch.stack([in_rank_TP.sum(0), slots_to_P], 1)


@dataclass
class SentRows:
    """The rows one rank sends: one per (token, destination rank), by destination rank, then token."""

    token_of_row: torch.Tensor  # [S] token of each sent row
    home_row_of_slot: torch.Tensor  # [T*P] sent row of (token, rank); S if the token skipped that rank
    home_slot_of_row: torch.Tensor  # [S] (token, rank) of each sent row
    ids_SK: torch.Tensor  # the destination's local expert of each of the row's slots, -1 for other ranks' slots
    weights_SK: torch.Tensor  # float32 routing weights of those slots, 0 for other ranks' slots


def route_tokens(
    topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, in_rank_TP: torch.Tensor, num_sent: int, num_local: int
) -> SentRows:
    """The sent rows of tokens routed to `topk_ids_TK` (rank_counts's `in_rank_TP`; `num_sent` its sum)."""
    T, P = in_rank_TP.shape
    device = topk_ids_TK.device
    # a stable sort of the (rank, token) flags
    sent_pt = torch.argsort((~in_rank_TP.t().reshape(-1)).to(torch.uint8), stable=True)[:num_sent]
    token_of_sent, rank_of_sent = sent_pt % T, sent_pt // T
    home_slot_of_row = token_of_sent * P + rank_of_sent
    home_row_of_slot = torch.full((T * P,), num_sent, dtype=torch.int64, device=device)
    home_row_of_slot[home_slot_of_row] = torch.arange(num_sent, device=device)
    ids_sent_SK = topk_ids_TK.index_select(0, token_of_sent)
    on_dest_SK = ids_sent_SK // num_local == rank_of_sent[:, None]
    ids_SK = torch.where(on_dest_SK, ids_sent_SK - rank_of_sent[:, None] * num_local, -1)
    weights_SK = topk_weights_TK.float().index_select(0, token_of_sent) * on_dest_SK
    return SentRows(token_of_sent, home_row_of_slot, home_slot_of_row, ids_SK, weights_SK)


def expert_major(
    recv_x: torch.Tensor, recv_ids_RK: torch.Tensor, num_local: int, num_rows: int, use_triton: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The received rows expanded to this rank's experts: (rows, rows per local expert, row_of_slot, slot_of_row).

    A stable sort of the received slots by local expert (others' slots last): rows in (local expert, source rank,
    source row) order.
    """
    num_recv, K = recv_ids_RK.shape
    device = recv_ids_RK.device
    keys = torch.where(recv_ids_RK >= 0, recv_ids_RK, num_local).reshape(-1)
    slot_of_row = stable_order(keys, num_local)[:num_rows]
    row_of_slot = torch.full((num_recv * K,), num_rows, dtype=torch.int64, device=device)
    row_of_slot[slot_of_row] = torch.arange(num_rows, device=device)
    tokens_per_local_expert = torch.zeros(num_local + 1, dtype=torch.int64, device=device).scatter_add_(
        0, keys, torch.ones_like(keys)
    )[:num_local]
    x_by_expert = expand_to_rows(recv_x, slot_of_row // K, row_of_slot, K, use_triton)
    return x_by_expert, tokens_per_local_expert, row_of_slot, slot_of_row


@dataclass
class AllToAllHandle:
    num_tokens: int
    send_splits: list[int]  # token rows this rank sent to each ep rank
    recv_splits: list[int]  # token rows this rank received from each ep rank
    recv_weights_RK: torch.Tensor  # routing weights of the received rows, 0 for other ranks' slots
    row_of_slot: torch.Tensor  # [R*K] expert-major row of each received slot; N if not local
    slot_of_row: torch.Tensor  # [N] received slot of each expert-major row
    home_row_of_slot: torch.Tensor  # [T*P] sent row of (token, rank); S if the token skipped that rank
    home_slot_of_row: torch.Tensor  # [S] (token, rank) of each sent row


class AllToAllDispatcher:
    """Sends each token once to every ep rank owning one of its experts: rank r owns [r*L, (r+1)*L)."""

    # the two required stages only: its counts are its own experts' rows, its combine weighs and sends home
    caps = NO_CAPS

    def __init__(self, num_experts: int, ep_group, combine: str = "torch"):
        self.use_triton = combine_uses_triton(combine)
        self.group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over ep={self.ep_size} ranks")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        P = self.ep_size
        in_rank_TP, counts_sent = rank_counts(topk_ids_TK, P, self.num_local_experts)
        # [src, (rows, slots)] this rank receives; then the layer's one host sync
        counts_recv = torch.empty_like(counts_sent)
        dist.all_to_all_single(counts_recv, counts_sent, group=self.group)
        sizes = torch.cat([counts_sent[:, 0], counts_recv[:, 0], counts_recv[:, 1].sum().view(1)]).tolist()
        send_splits, recv_splits, num_rows = sizes[:P], sizes[P : 2 * P], sizes[2 * P]

        sent = route_tokens(topk_ids_TK, topk_weights_TK, in_rank_TP, sum(send_splits), self.num_local_experts)
        x_sent = expand_to_rows(x_TD, sent.token_of_row, sent.home_row_of_slot, P, self.use_triton)
        recv_x = _all_to_all(x_sent, recv_splits, send_splits, self.group)
        recv_w = _all_to_all(sent.weights_SK, recv_splits, send_splits, self.group)
        recv_ids = torch.empty((sum(recv_splits), sent.ids_SK.shape[1]), dtype=sent.ids_SK.dtype, device=x_TD.device)
        dist.all_to_all_single(recv_ids, sent.ids_SK.contiguous(), recv_splits, send_splits, group=self.group)

        x_by_expert, tokens_per_local_expert, row_of_slot, slot_of_row = expert_major(
            recv_x, recv_ids, self.num_local_experts, num_rows, self.use_triton
        )
        handle = AllToAllHandle(
            topk_ids_TK.shape[0],
            send_splits,
            recv_splits,
            recv_w,
            row_of_slot,
            slot_of_row,
            sent.home_row_of_slot,
            sent.home_slot_of_row,
        )
        return x_by_expert, tokens_per_local_expert, handle

    def combine(self, y_by_expert_ND, handle: AllToAllHandle):
        # weighted sum of this rank's experts per received token, sent home, added per token
        partial_RD = weighted_sum(
            y_by_expert_ND, handle.recv_weights_RK, handle.row_of_slot, handle.slot_of_row, self.use_triton
        )
        partial_home_SD = _all_to_all(partial_RD, handle.send_splits, handle.recv_splits, self.group)
        ones_TP = torch.ones(handle.num_tokens, self.ep_size, device=partial_home_SD.device)
        return weighted_sum(partial_home_SD, ones_TP, handle.home_row_of_slot, handle.home_slot_of_row, self.use_triton)
