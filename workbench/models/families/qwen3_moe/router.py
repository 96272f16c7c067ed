"""Qwen3-MoE's router with float32 logits: the family's extra on the generic path.

In bf16 the router's gradient is a small difference of large terms (softmax, top-k
renormalization); float32 logits (moe/router.router_logits: bf16 products, float32 sums) keep it
close to a float32 model where Transformers' bf16 logits were 18% off. Float32 models compute the
same numbers as Transformers. The class is a subclass of Transformers' router, so the model's own
output recording still captures `router_logits` and Transformers computes the aux loss.
"""

from __future__ import annotations

import torch
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from workbench.models.class_swap import swap_classes
from workbench.models.router_records import RecordsTopkIds
from workbench.moe.router import SOFTMAX_TOPK_BACKENDS, router_logits, router_logits_passing

# Shape suffixes: T tokens, D hidden, E experts, K top-k.


class Qwen3MoeEngineRouter(RecordsTopkIds, hf.Qwen3MoeTopKRouter):
    """Transformers' Qwen3MoeTopKRouter whose logits are computed in float32."""

    # Output 2, the top-k ids, is the top-k of the float32 softmax of float32 logits: what the aux loss's
    # formula picks (models/router_aux records them; the loss then sorts no probabilities again).
    topk_ids_index = 2
    topk_backend: str = "torch"  # the resolved BackendConfig.router, set by use_engine_router

    def forward(self, hidden_states: torch.Tensor, pass_input: bool = False):
        """(router logits [T, E] float32, top-k weights [T, K], top-k ids [T, K]) as Transformers returns them.

        `pass_input`: a fourth output, the [T, D] input for the experts, whose gradient the router's backward adds
        to its own in one GEMM (moe/router.router_logits_passing; the engine's decoder layer asks for it).
        """
        x_TD = hidden_states.reshape(-1, self.hidden_dim)
        if pass_input:
            logits_TE, x_TD = router_logits_passing(x_TD, self.weight)
        else:
            logits_TE = router_logits(x_TD, self.weight)
        topk = SOFTMAX_TOPK_BACKENDS.impl(self.topk_backend)
        weights_TK, ids_TK = topk(logits_TE, self.top_k, self.norm_topk_prob)
        return (logits_TE, weights_TK, ids_TK, x_TD) if pass_input else (logits_TE, weights_TK, ids_TK)


def use_engine_router(model: torch.nn.Module, backend: str = "torch") -> int:
    """Every Qwen3MoeTopKRouter of `model` computes float32 logits (a class swap: same parameters).

    `backend`: a resolved BackendConfig.router, the softmax + top-k kernel of each swapped router.
    """
    return swap_classes(model, hf.Qwen3MoeTopKRouter, Qwen3MoeEngineRouter, topk_backend=backend)
