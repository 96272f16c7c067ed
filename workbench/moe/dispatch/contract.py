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

What a dispatcher offers beyond the two required stages is declared once, typed, in its class's `caps`
(DispatcherCaps), and read once, when an experts module is built (moe/hf_experts.ExpertsPlan): the forward never
asks a dispatcher what it can do. A dispatcher that overlaps communication with the GEMMs (chunked all-to-all on a
second stream, DeepEP's async handles) keeps the same stages and order.

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
