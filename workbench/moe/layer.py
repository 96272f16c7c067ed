"""The MoE block: router + dispatcher + experts. Knows nothing about any model family."""

from __future__ import annotations

import torch
from torch import nn
from torch.profiler import record_function

from workbench.moe.experts import GroupedExperts


def _in_backward() -> bool:
    # Activation-checkpoint recomputation runs forward inside backward; counting there would
    # count each token twice.
    return torch._C._current_graph_task_id() != -1


class MoEBlock(nn.Module):
    """Routes each token to top-k experts and returns the weighted sum of their outputs.

    `gate` is the family's router module returning (router_logits, topk_weights, topk_ids);
    `experts` holds this rank's experts; `dispatcher` moves tokens to them and back.
    """

    def __init__(self, gate: nn.Module, experts: GroupedExperts, dispatcher, num_experts: int):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.dispatcher = dispatcher
        self.num_experts = num_experts
        # Tokens routed to each expert (this rank's tokens) since the trainer last read it;
        # an integer buffer so model.to(dtype) leaves it alone.
        self.register_buffer("tokens_per_expert", torch.zeros(num_experts, dtype=torch.int64), persistent=False)

    def forward(self, hidden_BSD: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = hidden_BSD.shape
        x_TD = hidden_BSD.reshape(-1, dim)
        # Phase labels for torch.profiler (the ProfilePanel's per-phase breakdown).
        with record_function("workbench.router"):
            _, topk_weights_TK, topk_ids_TK = self.gate(x_TD)
            if not _in_backward():
                with torch.no_grad():
                    ids = topk_ids_TK.reshape(-1)
                    self.tokens_per_expert.scatter_add_(0, ids, torch.ones_like(ids))
        with record_function("workbench.dispatch"):
            x_by_expert, tokens_per_expert, handle = self.dispatcher.dispatch(x_TD, topk_ids_TK, topk_weights_TK)
        with record_function("workbench.experts"):
            y_by_expert = self.experts(x_by_expert, tokens_per_expert)
        with record_function("workbench.combine"):
            y_TD = self.dispatcher.combine(y_by_expert, handle)
        return y_TD.reshape(batch, seq, dim)


def moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """The engine's MoE blocks in module order."""
    return [m for m in model.modules() if isinstance(m, MoEBlock)]


def pop_expert_load(model: nn.Module) -> torch.Tensor:
    """Tokens routed per expert per MoE layer since the last call, [num_moe_layers, num_experts]; resets."""
    blocks = moe_blocks(model)
    if not blocks:
        return torch.zeros(0, 0)
    load = torch.stack([b.tokens_per_expert.detach().clone() for b in blocks])
    for b in blocks:
        b.tokens_per_expert.zero_()
    return load.cpu()
