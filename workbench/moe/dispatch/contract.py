"""The dispatcher contract: the stages an engine experts module calls, in one order, and what each dispatcher offers.

An engine experts module (moe/hf_experts.EngineExperts.forward) runs one MoE layer's tokens through these stages,
always in this order:

    1. dispatch(x_TD, topk_ids_TK, topk_weights_TK) -> (x_ND, tokens_per_expert, handle)
         the router's choices -> rows in expert-major order on the ranks that own their experts;
         tokens_per_expert: rows per local expert; handle: what combine needs to bring them back.
    2. row_weights(handle) -> weights_N                       [only where caps.rows_take_weights]
         each row's routing weight, for experts that scale their SwiGLU rows by it (moe/row_weights.py).
    3. the experts' GEMMs on the rows (the experts module's own: moe/hf_experts.expert_rows).
    4. combine(y_ND, handle[, residual_TD][, weighted=False]) -> y_TD
         the rows back in token order, each token's k rows summed (float32) with its routing weights;
         weighted=False: a plain sum of rows that carry their weights (only where caps.rows_take_weights);
         residual_TD: a residual stream added in the same sum (only where caps.combine_adds_residual).

A dispatcher that overlaps its communication with the GEMMs has to see the GEMMs: one with caps.pipelines_experts
(alltoall_overlap) runs the stages itself, chunk by chunk, when the experts module hands it step 3:

    run_stages(x_TD, topk_ids_TK, topk_weights_TK, experts) -> y_TD       [only where caps.pipelines_experts]
         experts(x_ND, tokens_per_expert) -> y_ND: the experts' GEMMs on one chunk's expert-major rows.
         Every chunk goes through the same stages in the same order (route, send, receive = step 1, step 3,
         weigh and send back, combine = step 4); only the chunks interleave: chunk c+1 is sent before chunk c's
         experts run, and chunk c is combined after chunk c+1's experts ran (moe/dispatch/alltoall_overlap.py).

What a dispatcher offers beyond the two required stages is declared once, typed, in its class's `caps`
(DispatcherCaps), and read once, when an experts module is built (moe/hf_experts.ExpertsPlan): the forward never
asks a dispatcher what it can do.

Work that needs none of the exchanged rows (a family's shared expert) could run in the exchanges' shadow, but it is
the family's MoE block, not the experts module, that calls it after the experts return: run_stages would need it
handed in (a `beside()` callable run between the first send and the first wait) and the blocks to pass it.

A dispatcher that holds communication buffers (deepep) also has `close()`, collective over its ep group and
idempotent, and `open_key`, the same on every rank of that group while a buffer is held (moe/dispatch/__init__).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

# Shape suffixes: T tokens, D hidden, K top-k, N routed rows.


@dataclass(frozen=True)
class DispatcherCaps:
    """What a dispatcher offers beyond dispatch and a weighted combine (all off: just those two)."""

    # dispatch's tokens_per_expert counts every expert's (token, slot) pairs (a single-rank dispatch): the routed
    # load counter (moe/routed_load.py) adds them instead of counting the router's choices again
    counts_every_expert: bool = False
    # row_weights(handle) gives each dispatched row's routing weight, and combine(weighted=False) sums plain rows
    rows_take_weights: bool = False
    # combine(..., residual_TD) adds a residual stream in its sum (the engine's fused decoder layers)
    combine_adds_residual: bool = False
    # run_stages(x, ids, weights, experts) runs the experts' GEMMs itself, chunk by chunk between its exchanges; the
    # experts module calls it instead of dispatch and combine
    pipelines_experts: bool = False


# A dispatcher offering nothing beyond the two required stages (and what an experts module built without a
# dispatcher, as kernel benchmarks build one, assumes).
NO_CAPS = DispatcherCaps()


class Dispatcher(Protocol):
    """Moves tokens to the experts that own them and back, in the stages above."""

    num_experts: int
    caps: ClassVar[DispatcherCaps]

    def dispatch(
        self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """Expert-major rows, rows per local expert, and a handle for `combine`."""
        ...

    def combine(self, y_by_expert_ND: torch.Tensor, handle: Any) -> torch.Tensor:
        """Weighted sum of each token's expert rows, in the original token order (caps: the optional arguments)."""
        ...


def caps_of(dispatcher: Dispatcher | None) -> DispatcherCaps:
    """`dispatcher`'s declared caps; NO_CAPS for none."""
    return NO_CAPS if dispatcher is None else dispatcher.caps
