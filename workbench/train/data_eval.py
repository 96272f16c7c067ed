"""Eval loss and token accuracy on the held-out sequences (data.eval_fraction / data.eval_files).

Every rank runs the same number of forwards (a sharded model's collectives need it): each takes
its share of each round of `world x local_batch_size` sequences, a rank past the end runs a
fully masked copy. Sums of cross-entropy, correct predictions and tokens are reduced over ranks,
so the loss is the mean over every eval token, as one forward of the whole eval set would give.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from workbench.models.host_packing import host_packing
from workbench.parallel import dist_utils as du
from workbench.train.data_batch import IGNORE_INDEX


@torch.no_grad()
def evaluate(model: torch.nn.Module, sequences, local_batch_size: int, device: torch.device) -> dict[str, float]:
    """{"eval_loss", "eval_accuracy", "eval_tokens"} over all of `sequences` (a MappedSequences or Batch)."""
    rank, world = du.rank(), du.world_size()
    n, per_round = len(sequences), world * local_batch_size
    was_training = model.training
    model.eval()
    ce_sum = correct = count = 0.0
    try:
        for first in range(0, n, per_round):
            start = min(n, first + rank * local_batch_size)
            stop = min(n, start + local_batch_size)
            if start < stop:
                batch = sequences.slice(start, stop)
            else:  # this rank is past the end: a masked stand-in keeps the forwards in step
                batch = sequences.slice(0, 1)
                batch.labels.fill_(IGNORE_INDEX)
            host_positions = batch.position_ids
            batch = batch.to(device)
            with host_packing(host_positions):
                out = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False)
            for row in range(len(batch)):  # float32 logits one sequence at a time: [S, vocab], not [B, S, vocab]
                logits = out.logits[row, :-1].float()
                targets = batch.labels[row, 1:]
                keep = targets != IGNORE_INDEX
                ce_sum += float(F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum"))
                correct += float(((logits.argmax(-1) == targets) & keep).sum())
                count += float(keep.sum())
    finally:
        model.train(was_training)
    ce_sum, correct, count = du.all_reduce_sum([ce_sum, correct, count])
    count = max(count, 1.0)
    return {"eval_loss": ce_sum / count, "eval_accuracy": correct / count, "eval_tokens": int(count)}


def eval_metrics(trainer: Any, step: int) -> dict[str, float]:
    """The eval keys for a step record: on every data.eval_every-th step and the last one, else none."""
    rc = trainer.rc
    every, held = rc.data.eval_every, getattr(trainer.stream, "eval_sequences", None)
    if held is None or not every or (step % every and step != rc.train.steps):
        return {}
    return evaluate(trainer.model, held, rc.train.local_batch_size, trainer.device)
