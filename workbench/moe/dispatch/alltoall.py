"""Expert-parallel dispatch over torch.distributed all-to-all (NCCL on GPUs, gloo on CPU).

Tokens travel to the ranks that own their experts with uneven splits and no padding, in
autograd-aware collectives, and come back the same way. One host sync per layer reads the
split sizes, which the collective needs on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

from workbench.moe.dispatch.local import (GatherRows, Permutation, inverse_permutation, permute, sort_by_expert,
                                          unpermute)


def _all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    out = all_to_all_single_autograd(x.contiguous(), output_splits, input_splits, group)
    return wait_tensor(out)


@dataclass
class AllToAllHandle:
    perm: Permutation
    topk_weights_TK: torch.Tensor
    input_splits: list[int]            # rows this rank sent to each ep rank
    output_splits: list[int]           # rows this rank received from each ep rank
    received_order: torch.Tensor       # expert-major row -> received row (a permutation)
    expert_major_order: torch.Tensor   # its inverse


class AllToAllDispatcher:
    """Sends each (token, slot) to the ep rank owning its expert: rank r owns [r*L, (r+1)*L)."""

    def __init__(self, num_experts: int, ep_group):
        self.group = ep_group
        self.ep_size = dist.get_world_size(ep_group)
        self.ep_rank = dist.get_rank(ep_group)
        if num_experts % self.ep_size:
            raise ValueError(f"{num_experts} experts cannot be split evenly over ep={self.ep_size} ranks")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep_size

    def dispatch(self, x_TD, topk_ids_TK, topk_weights_TK):
        perm, tokens_per_expert_E = sort_by_expert(topk_ids_TK, self.num_experts)
        x_sorted = permute(x_TD, perm)  # ordered by expert, hence by destination rank

        # counts_received[src, e]: rows rank `src` sends to my local expert e.
        counts_received = torch.empty_like(tokens_per_expert_E)
        dist.all_to_all_single(counts_received, tokens_per_expert_E, group=self.group)
        counts_sent_PL = tokens_per_expert_E.view(self.ep_size, self.num_local_experts)
        counts_received_PL = counts_received.view(self.ep_size, self.num_local_experts)
        # The one host sync of the layer: both split lists in a single copy to the host.
        splits = torch.cat([counts_sent_PL.sum(1), counts_received_PL.sum(1)]).tolist()
        input_splits, output_splits = splits[:self.ep_size], splits[self.ep_size:]

        x_received = _all_to_all(x_sorted, output_splits, input_splits, self.group)
        received_order = self._expert_major_order(counts_received_PL, sum(output_splits))
        inverse = inverse_permutation(received_order)
        x_by_expert = GatherRows.apply(x_received, received_order, inverse)
        tokens_per_local_expert = counts_received_PL.sum(0)
        handle = AllToAllHandle(perm, topk_weights_TK, input_splits, output_splits, received_order, inverse)
        return x_by_expert, tokens_per_local_expert, handle

    def combine(self, y_by_expert_ND, handle: AllToAllHandle):
        # Undo the local regrouping, send rows home, then weight and sum per token.
        y_received = GatherRows.apply(y_by_expert_ND, handle.expert_major_order, handle.received_order)
        y_sorted = _all_to_all(y_received, handle.input_splits, handle.output_splits, self.group)
        return unpermute(y_sorted, handle.topk_weights_TK, handle.perm)

    @staticmethod
    def _expert_major_order(counts_PL: torch.Tensor, total: int) -> torch.Tensor:
        """Index of the received rows in (expert, source rank) order.

        Received rows arrive grouped by source rank, each source's rows grouped by local expert;
        the experts want all rows of expert 0 first, then expert 1, and so on.
        """
        num_src, num_local = counts_PL.shape
        flat = counts_PL.reshape(-1)
        starts = torch.cumsum(flat, 0) - flat                   # start of chunk (src, e) in received rows
        order_chunks = torch.arange(num_src * num_local, device=flat.device)
        order_chunks = order_chunks.view(num_src, num_local).t().reshape(-1)  # (e, src) chunk order
        chunk_sizes = flat[order_chunks]
        chunk_starts = starts[order_chunks]
        within = torch.arange(total, device=flat.device) - torch.repeat_interleave(
            torch.cumsum(chunk_sizes, 0) - chunk_sizes, chunk_sizes, output_size=total)
        return torch.repeat_interleave(chunk_starts, chunk_sizes, output_size=total) + within
