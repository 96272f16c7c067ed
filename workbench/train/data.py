"""Training data: seeded synthetic tokens, or JSONL SFT rows rendered with the chat template.

Both sources become fixed-length sequences `[seq_len]` of (input_ids, labels, position_ids).
`TokenStream` serves them in a deterministic, seeded order; its only state is how many
sequences have been consumed, so a resumed run continues exactly where the checkpoint left off.
Every rank builds the same stream and takes its own contiguous slice of each global batch.
"""

from __future__ import annotations

from typing import Any

import torch

from workbench.train.data_batch import Batch, TokenCheck, pack_examples
from workbench.train.data_cache import build_cached
from workbench.train.data_messages import load_sft_examples
from workbench.train.data_tokenizer import check_vocab, load_tokenizer, pad_token_id, resolve_tokenizer_dir


class TokenStream:
    """Deterministic, resumable source of global batches (same on every rank)."""

    def __init__(
        self, sequences: Batch | None, *, seed: int, seq_len: int, vocab_size: int | None = None, eval_sequences=None
    ) -> None:
        self.sequences = sequences  # a Batch, or anything with len() and .slice() (data_cache.MappedSequences)
        self.eval_sequences = eval_sequences  # held-out sequences for eval (kind="datasets"), or None
        self.seed = seed
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.consumed = 0  # sequences handed out so far, over all ranks
        self._perm_epoch = -1
        self._perm: torch.Tensor | None = None
        if sequences is None and vocab_size is None:
            raise ValueError("synthetic data needs vocab_size")

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(len(self.sequences), generator=g)
            self._perm_epoch = epoch
        return self._perm

    def _synthetic(self, index: int) -> Batch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ids = torch.randint(0, self.vocab_size, (1, self.seq_len), generator=g)
        return Batch(ids, ids.clone(), torch.arange(self.seq_len).unsqueeze(0))

    def _sequence(self, index: int) -> Batch:
        if self.sequences is None:
            return self._synthetic(index)
        n = len(self.sequences)
        j = int(self._permutation(index // n)[index % n])
        return self.sequences.slice(j, j + 1)

    def next_batch(self, global_batch_size: int, start: int = 0, stop: int | None = None) -> Batch:
        """Sequences [start, stop) of the next global batch; advances past the whole batch."""
        stop = global_batch_size if stop is None else stop
        first = self.consumed
        parts = [self._sequence(first + i) for i in range(start, stop)]
        self.consumed += global_batch_size
        return Batch(*(torch.cat([getattr(p, f) for p in parts]) for f in ("input_ids", "labels", "position_ids")))

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self.consumed, "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed") != self.seed:
            raise ValueError(f"checkpoint data stream used seed {state.get('seed')}, this run uses {self.seed}")
        self.consumed = int(state["consumed"])


def build_stream(
    data_cfg, seed: int, vocab_size: int, model_path: str | None = None, runs_dir: str | None = None
) -> TokenStream:
    """The TokenStream for a DataConfig: JSONL tokenized in memory, `datasets` through the on-disk cache."""
    if data_cfg.kind == "synthetic":
        return TokenStream(None, seed=seed, seq_len=data_cfg.seq_len, vocab_size=vocab_size)
    tokenizer_dir = resolve_tokenizer_dir(data_cfg, model_path)
    if data_cfg.kind == "datasets":
        train, held_out = build_cached(data_cfg, tokenizer_dir, vocab_size, runs_dir)
        return TokenStream(train, seed=seed, seq_len=data_cfg.seq_len, eval_sequences=held_out)
    tokenizer = load_tokenizer(tokenizer_dir)
    check_vocab(len(tokenizer), tokenizer_dir, vocab_size)
    examples = load_sft_examples(data_cfg.resolved_path, tokenizer, data_cfg.example_max_length)
    sequences = pack_examples(examples, data_cfg.seq_len, pad_token_id(tokenizer), data_cfg.pack)
    TokenCheck.of(sequences).refuse(
        vocab_size, f"{data_cfg.resolved_path} (tokenized with {tokenizer_dir})", "rows need non-empty responses"
    )
    return TokenStream(sequences, seed=seed, seq_len=data_cfg.seq_len)
