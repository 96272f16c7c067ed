"""What the router hooks record in one forward: where they put the router logits (RouterLogitSink), and the mixin of
an engine router whose top-k ids are the aux loss's own choice (RecordsTopkIds). A leaf: the engine state holds a
sink, the routers mix the class in, and models/router_aux's hooks and losses read both."""

from __future__ import annotations

import torch


class RecordsTopkIds:
    """Mixin of an engine router whose output `topk_ids_index` is the top-k of the float32 softmax of its float32
    logits: the aux loss's own choice, which the router hooks record beside the logits."""

    topk_ids_index: int | None = None


class RouterLogitSink:
    """Where the router hooks put one forward's router logits (None between forwards: nothing is kept).

    `topk_ids` gets the top-k ids of the routers that declare them equal to the aux loss's own choice
    (RecordsTopkIds), so the aux loss does not sort each layer's [T, E] probabilities again.
    """

    def __init__(self) -> None:
        self.logits: list[torch.Tensor] | None = None
        self.topk_ids: list[torch.Tensor] | None = None
