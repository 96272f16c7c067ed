"""Packed token sequences: the Batch the trainer steps on, how examples are packed into fixed-length rows, and the
check that their ids and labels fit the model (TokenCheck).

A sequence is `[seq_len]` of (input_ids, labels, position_ids); labels are -100 where no loss is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from workbench.errors import DataError

IGNORE_INDEX = -100


@dataclass
class Batch:
    """Token tensors `[B, S]`; labels are -100 where no loss is taken (prompts, padding)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def slice(self, start: int, stop: int) -> Batch:
        return Batch(self.input_ids[start:stop], self.labels[start:stop], self.position_ids[start:stop])

    def to(self, device: torch.device | str) -> Batch:
        return Batch(self.input_ids.to(device), self.labels.to(device), self.position_ids.to(device))

    def num_loss_tokens(self) -> int:
        """Tokens that enter the loss: labels are shifted left by one inside the model."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())


class TokenCheck:
    """What the model needs of packed sequences, gathered over blocks of them: ids in its vocabulary,
    labels that are -100 or in it, and at least one label to train on.

    The embedding and the loss would otherwise fail deep inside the first step (an IndexError), or a
    run would "train" on nothing but the aux loss.
    """

    def __init__(self) -> None:
        self.id_range = (0, -1)  # (lowest, highest) token id seen; empty while highest < lowest
        self.label_range = (0, -1)  # the same over the labels that enter the loss
        self.loss_tokens = 0  # labels after the first of a sequence that are not -100 (the shifted loss)

    def add(self, ids: np.ndarray, labels: np.ndarray) -> None:
        """Take in a block `[n, seq_len]` of input ids and labels."""
        if ids.size:
            self.id_range = _widen(self.id_range, int(ids.min()), int(ids.max()))
        kept = labels[labels != IGNORE_INDEX]
        if kept.size:
            self.label_range = _widen(self.label_range, int(kept.min()), int(kept.max()))
        self.loss_tokens += int((labels[:, 1:] != IGNORE_INDEX).sum())

    def refuse(self, vocab_size: int, where: str, masked_fix: str) -> None:
        """Raise a DataError naming `where` if the sequences cannot train a model of `vocab_size` tokens."""
        if self.loss_tokens == 0:
            raise DataError(f"{where}: every label is masked, so there is no token to train on; {masked_fix}")
        for what, (low, high) in (("token id", self.id_range), ("label", self.label_range)):
            bad = low if low < 0 else high if high >= vocab_size else None
            if bad is not None:
                raise DataError(
                    f"{where}: {what} {bad} is outside the model's vocabulary (vocab_size {vocab_size}: ids 0 to "
                    f"{vocab_size - 1}); the tokenizer does not match the model: use the model's own tokenizer "
                    "(data.tokenizer), or a model whose vocab_size covers every id"
                )

    @classmethod
    def of(cls, batch: Batch) -> TokenCheck:
        check = cls()
        check.add(batch.input_ids.numpy(), batch.labels.numpy())
        return check


def _widen(bounds: tuple[int, int], low: int, high: int) -> tuple[int, int]:
    return (low, high) if bounds[1] < bounds[0] else (min(bounds[0], low), max(bounds[1], high))


def iter_packed(examples, seq_len: int, pack: bool = True):
    """(ids, labels, position_ids) lists per sequence: greedy packing in order (or one example each).

    position_ids restart at 0 for every example, which makes Transformers' mask block-diagonal
    (no attention across packed examples). A packed example's first label is -100: the shifted loss would
    otherwise predict it from the previous example's last token (a row's first label is never a target).
    Sequences come unpadded (at most seq_len long).
    """
    cur: tuple[list[int], list[int], list[int]] = ([], [], [])
    for ids, labels in examples:
        if cur[0] and (not pack or len(cur[0]) + len(ids) > seq_len):
            yield cur
            cur = ([], [], [])
        if cur[0] and len(labels):  # not the row's first example: its first token is no target
            labels = [IGNORE_INDEX, *labels[1:]]
        cur[0].extend(ids)
        cur[1].extend(labels)
        cur[2].extend(range(len(ids)))
    if cur[0]:
        yield cur


def pad_sequence_into(
    out_ids, out_labels, out_pos, ids: list[int], labels: list[int], pos: list[int], pad_id: int
) -> None:
    """Write one packed sequence into numpy rows of fixed width; padding gets label -100 and its own positions."""
    k, seq_len = len(ids), out_ids.shape[-1]
    out_ids[:k], out_ids[k:] = ids, pad_id
    out_labels[:k], out_labels[k:] = labels, IGNORE_INDEX
    out_pos[:k] = pos
    out_pos[k:] = np.arange(seq_len - k)  # padding is its own "document"


def pack_examples(examples: list[tuple[list[int], list[int]]], seq_len: int, pad_id: int, pack: bool = True) -> Batch:
    """Fixed-length sequences `[n, seq_len]` from `iter_packed`, in memory."""
    seqs = list(iter_packed(examples, seq_len, pack))
    n = len(seqs)
    arrays = [np.empty((n, seq_len), dtype=np.int64) for _ in range(3)]
    for i, (ids, labels, pos) in enumerate(seqs):
        pad_sequence_into(*(a[i] for a in arrays), ids, labels, pos, pad_id)
    return Batch(*(torch.from_numpy(a) for a in arrays))
