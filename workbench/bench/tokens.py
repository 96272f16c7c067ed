"""Seeded synthetic token batches, identical for every variant and independent of the mesh."""

from __future__ import annotations

import torch


def global_batch(step: int, seed: int, rows: int, seq: int, vocab_size: int) -> torch.Tensor:
    """Token ids `[rows, seq]` (int64, CPU) for one step of the whole world.

    Zipf-distributed tokens with the second half of each row copying the first: a fresh model
    can lower its loss (unigram statistics first, copying later), so loss curves carry signal,
    unlike uniform noise that stays at log(vocab).
    """
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    ranks = torch.arange(1, vocab_size + 1, dtype=torch.float64)
    probs = 1.0 / (ranks + 10.0)
    # Shuffle which ids are frequent (seeded by `seed` only) so it is not simply the low ids.
    perm = torch.randperm(vocab_size, generator=torch.Generator().manual_seed(seed))
    ids = torch.multinomial(probs, rows * seq, replacement=True, generator=gen).view(rows, seq)
    ids = perm[ids]
    half = seq // 2
    ids[:, seq - half:] = ids[:, :half]
    return ids


def rank_slice(ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s contiguous rows of the global batch."""
    per_rank = ids.shape[0] // world
    return ids[rank * per_rank:(rank + 1) * per_rank]


def label_count(rows: int, seq: int) -> int:
    """Tokens that carry a loss in a batch: Transformers shifts labels, so seq - 1 per row."""
    return rows * (seq - 1)
