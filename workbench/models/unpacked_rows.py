"""Answer Transformers' packed-rows question from the host's position ids, so a training forward never waits on it.

Transformers' masks (masking_utils._preprocess_mask_arguments) ask `find_packed_sequence_indices` whether rows
hold several documents whenever position ids come without a 2D mask or cache, as in every sdpa family's training
forward. It answers with `(packed_sequence_mask[:, -1] == 0).all()`: a device read that drains the queue at the
start of every forward (1 x H200, Moonlight L8 seq 4096 x 2: ~15 ms of cudaStreamSynchronize per step; eager step
135.9 vs 138.4 ms queued without it, benchmarks/NOTES.md session 11). The trainer holds those position ids on the
host before it copies them, so it can say that no row restarts; inside `rows_known_unpacked` the check returns
Transformers' own "not packed" answer (None) for position ids of that length without reading the device. Packed
rows, other lengths and every call outside the context take Transformers' own path unchanged.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps

import torch
from transformers import masking_utils

# The sequence length whose rows the host found unpacked in the forward now running (None: no claim).
_UNPACKED_LENGTH: ContextVar[int | None] = ContextVar("workbench_unpacked_length", default=None)
_MARK = "_workbench_host_answer"


def host_rows_unpacked(position_ids: torch.Tensor | None) -> bool:
    """Whether no row of host-side `position_ids` [B, S] restarts (every step +1): Transformers' 'not packed'."""
    if position_ids is None or position_ids.device.type != "cpu" or position_ids.dim() != 2:
        return False
    return bool((position_ids.diff(dim=-1) == 1).all())


def _install() -> None:
    """Wrap masking_utils.find_packed_sequence_indices once; the wrapper defers to the original outside a claim."""
    original = masking_utils.find_packed_sequence_indices
    if getattr(original, _MARK, False):
        return

    @wraps(original)
    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        length = _UNPACKED_LENGTH.get()
        if length is not None and position_ids.dim() == 2 and position_ids.shape[-1] == length:
            return None
        return original(position_ids)

    setattr(find_packed_sequence_indices, _MARK, True)
    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices


@contextmanager
def rows_known_unpacked(position_ids: torch.Tensor | None) -> Iterator[bool]:
    """Within: Transformers' masks take host `position_ids`' rows as unpacked if they are; yields whether they are."""
    unpacked = host_rows_unpacked(position_ids)
    if not unpacked:
        yield False
        return
    _install()
    token = _UNPACKED_LENGTH.set(position_ids.shape[-1])
    try:
        yield True
    finally:
        _UNPACKED_LENGTH.reset(token)
