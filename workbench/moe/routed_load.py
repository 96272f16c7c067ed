"""Tokens routed to each expert, counted on the generic path's experts modules for the plots and the bias update.

Each engine experts module holds an int64 counter `[E]` of the (token, slot) pairs its router sent
to each expert, this rank's tokens only, over all E experts (also under expert parallelism: it
counts the router's choices before dispatch). Counting is a device-side scatter_add: no host sync
until the trainer reads the counters once per step.
"""

from __future__ import annotations

import torch
from torch import nn

LOAD_BUFFER = "workbench_tokens_per_expert"


def attach_load_counter(module: nn.Module, num_experts: int) -> None:
    """Give `module` a zeroed `[num_experts]` counter (a non-persistent buffer: not in state dicts)."""
    device = module.down_proj.device
    module.register_buffer(LOAD_BUFFER, torch.zeros(num_experts, dtype=torch.int64, device=device), persistent=False)


def count_routed(module: nn.Module, top_k_index: torch.Tensor, tokens_per_expert: torch.Tensor | None = None) -> None:
    """Add the router's choices `[T, K]` to `module`'s counter, except in an activation-checkpoint replay.

    `tokens_per_expert`: those choices already counted over all experts (a single-rank dispatch's counts),
    added as they are instead of counted again (a scatter_add of T x K ones into E bins: ~20 us a layer).
    """
    # Recomputation runs the forward again inside backward: counting there would count each token twice.
    counts = getattr(module, LOAD_BUFFER, None)
    if counts is None or torch._C._current_graph_task_id() != -1:
        return
    with torch.no_grad():
        if tokens_per_expert is not None:
            if tokens_per_expert.shape != counts.shape:
                raise ValueError(
                    f"tokens_per_expert {tuple(tokens_per_expert.shape)} is not the counter's {tuple(counts.shape)}"
                )
            counts.add_(tokens_per_expert.to(device=counts.device, dtype=counts.dtype))
            return
        ids = top_k_index.reshape(-1).to(device=counts.device, dtype=torch.int64)
        counts.scatter_add_(0, ids, torch.ones_like(ids))


def load_counters(model: nn.Module) -> list[torch.Tensor]:
    """The counters of every counting module of `model`, in module order (one per MoE layer)."""
    return [getattr(m, LOAD_BUFFER) for m in model.modules() if isinstance(getattr(m, LOAD_BUFFER, None), torch.Tensor)]


def pop_routed_load(model: nn.Module) -> torch.Tensor:
    """This rank's routed tokens `[layers, experts]` since the last call, on the model's device; resets."""
    counters = load_counters(model)
    if not counters:
        return torch.zeros(0, 0, dtype=torch.int64)
    load = torch.stack([c.detach().clone() for c in counters])
    for c in counters:
        c.zero_()
    return load
