"""Ergo's experts on the engine's expert-major rows: ErgoExperts's own forward, not only the decorated projections.

ErgoExperts (Transformers) gives every (token, expert) route a row of its own, runs the decorated projections on it
(relu² of the up projection, then the down projection; transposed [E, in, out] weights, no gate) with unit weights,
scales each route by its expert's own RMSNorm (post_expert_norm: a float32 rms_norm times weight[expert]) and only
then sums the routes with the router's weights. The engine's rows are already one per route and its combine weighs
and sums them, so the rows here are the projections followed by the expert's norm; the combine does the rest.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.moe.hf_experts import expert_linear, expert_offsets

# Shape suffixes: N routed rows, D hidden.


def ergo_expert_rows(module: nn.Module, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """ErgoExperts on expert-major rows: relu²(x @ up[e]) @ down[e], then expert e's post_expert_norm."""
    offsets = expert_offsets(module, tokens_per_expert)  # one cumsum for both GEMMs and their adapters
    h = module.act_fn(expert_linear(module, "up_proj", x_ND, tokens_per_expert, offsets))  # with LoRA rows, if any
    y_ND = expert_linear(module, "down_proj", h, tokens_per_expert, offsets)
    first, last = module.plan.expert_range
    experts = torch.arange(first, last, device=y_ND.device)
    # each row's expert, without a host sync; the norm's weight holds every expert (ep=1: install refuses ep > 1)
    ids_N = torch.repeat_interleave(experts, tokens_per_expert, output_size=y_ND.shape[0])
    return module.post_expert_norm(y_ND, ids_N)  # Transformers' own module: its float32 norm and cast back
