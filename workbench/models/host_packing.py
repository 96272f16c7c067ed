"""Answer Transformers' packed-rows question from the host's position ids, so a training forward never waits on it.

Transformers' masks (masking_utils._preprocess_mask_arguments) ask `find_packed_sequence_indices` whether rows
hold several documents whenever position ids come without a 2D mask or cache, as in every sdpa family's training
forward. It builds a document index per token on the device and answers with `(packed_sequence_mask[:, -1] ==
0).all()`: a device read that drains the queue at the start of every forward (1 x H200, Moonlight L8 seq 4096 x 2:
eager step 138.4 -> 135.9 ms queued without it, 2026-12-02). The trainer holds those position
ids on the host before it copies them, so inside `host_packing` the function answers from what the host found: None
(Transformers' "not packed") where no row restarts, else the same document index, built on the device with no read.
Other lengths and every call outside the context take Transformers' own function unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps

import torch
from transformers import masking_utils

from workbench.models.attention_sinks_reference import document_starts

# (sequence length, whether a row restarts) of the host batch whose forward is running; None: no claim.
_HOST_ROWS: ContextVar[tuple[int, bool] | None] = ContextVar("workbench_host_rows", default=None)
_MARK = "_workbench_host_answer"


def host_rows_packed(position_ids: torch.Tensor | None) -> bool | None:
    """Whether a row of host-side `position_ids` [B, S] restarts (a step other than +1); None: not host [B, S] ids."""
    if position_ids is None or position_ids.device.type != "cpu" or position_ids.dim() != 2:
        return None
    return bool(_starts(position_ids)[:, 1:].any())


def known_unpacked(seq_len: int) -> bool:
    """Whether the running forward's rows of `seq_len` tokens are known, from the host, to hold one document each."""
    claim = _HOST_ROWS.get()
    return claim is not None and claim[0] == seq_len and not claim[1]


def document_index(position_ids: torch.Tensor) -> torch.Tensor:
    """Transformers' packed_sequence_mask: per token, its document's index in the row (a new one at each restart)."""
    return _starts(position_ids).cumsum(-1) - 1


def _starts(position_ids: torch.Tensor) -> torch.Tensor:
    """Bool [B, S]: each document's first token, by the one rule the sink attention uses too."""
    batch, seq = position_ids.shape
    return document_starts(position_ids, batch, seq, position_ids.device)


def _install() -> None:
    """Wrap masking_utils.find_packed_sequence_indices once; the wrapper defers to the original outside a claim."""
    original = masking_utils.find_packed_sequence_indices
    if getattr(original, _MARK, False):
        return

    @wraps(original)
    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        claim = _HOST_ROWS.get()
        if claim is None or position_ids.dim() != 2 or position_ids.shape[-1] != claim[0]:
            return original(position_ids)
        return document_index(position_ids) if claim[1] else None

    setattr(find_packed_sequence_indices, _MARK, True)
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


@contextmanager
def host_packing(position_ids: torch.Tensor | None) -> Iterator[bool | None]:
    """Within: Transformers' masks take the rows' packing from host `position_ids`; yields host_rows_packed's answer."""
    packed = host_rows_packed(position_ids)
    if packed is None:
        yield None
        return
    _install()
    token = _HOST_ROWS.set((position_ids.shape[-1], packed))
    try:
        yield packed
    finally:
        _HOST_ROWS.reset(token)
