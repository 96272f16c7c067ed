"""Token dispatch: route tokens to their experts in expert-major order, and combine back.

Every dispatcher implements one protocol:
    dispatch(x_TD, topk_ids_TK, topk_weights_TK) -> (x_by_expert_ND, tokens_per_expert, handle)
    combine(y_by_expert_ND, handle) -> y_TD
where `tokens_per_expert` counts rows for this rank's local experts, and `combine` applies the
routing weights and sums each token's k expert outputs.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from workbench.moe.dispatch.local import LocalDispatcher, Permutation, permute, sort_by_expert, unpermute


class Dispatcher(Protocol):
    """Moves tokens to the experts that own them and back."""

    num_experts: int

    def dispatch(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Expert-major tokens, tokens per local expert, and a handle for `combine`."""
        ...

    def combine(self, y_by_expert_ND: torch.Tensor, handle: Any) -> torch.Tensor:
        """Weighted sum of each token's expert outputs, in the original token order."""
        ...


def make_dispatcher(name: str, num_experts: int, ep_group=None) -> Dispatcher:
    """The dispatcher called `name` (a resolved BackendConfig.dispatcher value)."""
    if name == "local":
        if ep_group is not None and ep_group.size() > 1:
            raise ValueError("dispatcher='local' cannot serve expert parallelism (ep > 1); use 'alltoall'")
        return LocalDispatcher(num_experts)
    if name == "alltoall":
        from workbench.moe.dispatch.alltoall import AllToAllDispatcher

        return AllToAllDispatcher(num_experts, ep_group)
    if name == "symm_mem":
        from workbench.moe.dispatch.symm_mem import SymmMemDispatcher

        return SymmMemDispatcher(num_experts, ep_group)
    if name == "deepep":
        from workbench.moe.dispatch.deepep import DeepEPDispatcher

        return DeepEPDispatcher(num_experts, ep_group)
    raise ValueError(f"unknown dispatcher {name!r}")


__all__ = ["Dispatcher", "LocalDispatcher", "Permutation", "make_dispatcher", "permute", "sort_by_expert",
           "unpermute"]
