"""DeepSeek-V3's (and Moonlight's) sigmoid router, logits on tensor cores: the family's extra on the generic path.

Transformers casts the bf16 hidden states and router weight to float32 and runs a float32 GEMM on FMA units,
forward and backward (~1.7 ms of Moonlight L8's step on an H200, 10b's profile). Products of bf16 values are
exact in float32, so `moe.router.router_logits` (bf16 GEMMs with float32 results, workbench/kernels/mm_fp32.py)
computes the same logits up to the order of the sums. The group-limited choice is skipped where it cannot limit
(one group, or every group kept: Moonlight's n_group = topk_group = 1), which leaves the same top-k. The class
is a subclass of Transformers' router, so parameters, buffers and the model's output recording stay its own.
"""

from __future__ import annotations

import torch
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

from workbench.models.class_swap import swap_classes
from workbench.moe.router import router_logits

# Shape suffixes: T tokens, D hidden, E experts, G groups, K top-k.


class DeepseekV3EngineRouter(hf.DeepseekV3TopkRouter):
    """Transformers' DeepseekV3TopkRouter whose float32 logits come from bf16 tensor-core GEMMs."""

    def forward(self, hidden_states: torch.Tensor):
        """(router logits [T, E] float32, top-k weights [T, K], top-k ids [T, K]) as Transformers returns them."""
        x_TD = hidden_states.reshape(-1, self.hidden_dim)
        if x_TD.dtype != self.weight.dtype or x_TD.dtype not in (torch.bfloat16, torch.float16):
            return super().forward(hidden_states)  # float32 weights or inputs: Transformers' own products
        logits_TE = router_logits(x_TD, self.weight)
        scores_TE = logits_TE.sigmoid()
        choice_TE = scores_TE + self.e_score_correction_bias
        groups = self.num_group
        if groups > 1 and self.topk_group < groups:
            per_group = choice_TE.view(-1, groups, self.num_experts // groups)
            group_score_TG = per_group.topk(2, dim=-1)[0].sum(dim=-1)
            kept_TG = torch.zeros_like(group_score_TG, dtype=torch.bool)
            kept_TG.scatter_(1, group_score_TG.topk(self.topk_group, dim=-1, sorted=False)[1], True)
            kept_TE = kept_TG.repeat_interleave(self.num_experts // groups, dim=1)
            choice_TE = choice_TE.masked_fill(~kept_TE, float("-inf"))
        ids_TK = choice_TE.topk(self.top_k, dim=-1, sorted=False)[1]
        weights_TK = scores_TE.gather(1, ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        return logits_TE, weights_TK * self.routed_scaling_factor, ids_TK


def use_deepseek_router(model: torch.nn.Module) -> int:
    """Every DeepseekV3TopkRouter of `model` computes its logits on tensor cores (a class swap: same parameters)."""
    return swap_classes(model, hf.DeepseekV3TopkRouter, DeepseekV3EngineRouter)
