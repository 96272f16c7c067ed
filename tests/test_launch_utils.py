"""The test helper that runs gloo ranks: every result arrives, a dead rank fails the call at once."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
from launch_utils import run_ranks

BIG = 8 << 20  # over a pipe's buffer: the hand-off must finish before the rank's os._exit


def _sum_and_big_payload(rank, world):
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return rank, float(t), bytes([rank]) * BIG


def _rank_1_exits(rank, world):
    if rank == 1:
        os._exit(7)
    return rank


def _rank_1_raises(rank, world):
    if rank == 1:
        raise ValueError("on purpose")
    return rank


def _rank_1_sleeps(rank, world):
    if rank == 1:
        time.sleep(600)
    return rank


@pytest.mark.slow
def test_results_arrive_for_every_rank():
    for _ in range(3):
        out = run_ranks(_sum_and_big_payload, 2)
        assert [(r, s) for r, s, _ in out] == [(0, 3.0), (1, 3.0)]
        assert [blob == bytes([r]) * BIG for r, _, blob in out] == [True, True]


@pytest.mark.slow
def test_rank_that_exits_without_result_fails_at_once_with_its_exit_code():
    # The timeout is far away: the failure must come from noticing the exit, not from waiting.
    with pytest.raises(RuntimeError, match=r"^rank 1 exited without a result \(exit code 7\)$"):
        run_ranks(_rank_1_exits, 2, timeout=120)


@pytest.mark.slow
def test_rank_error_is_raised_with_its_traceback():
    with pytest.raises(RuntimeError, match=r"(?s)^rank 1 failed:.*ValueError: on purpose"):
        run_ranks(_rank_1_raises, 2, timeout=120)


@pytest.mark.slow
def test_silent_rank_times_out_naming_it():
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] of 2 sent no result within 5 s"):
        run_ranks(_rank_1_sleeps, 2, timeout=5)


def _tensor_result(rank, world):
    # Many tensors: fetching each descriptor takes a round trip, long enough for the rank to exit.
    return {"rank": [torch.full((1024,), float(rank)) for _ in range(200)]}


@pytest.mark.slow
def test_tensor_results_arrive_after_the_rank_exits():
    # torch's multiprocessing pickler would send tensors as shared-memory descriptors, which the
    # parent fetches from the sender: gone after its os._exit (ConnectionResetError).
    results = run_ranks(_tensor_result, 2)
    assert [sum(float(t.sum()) for t in r["rank"]) for r in results] == [0.0, 200 * 1024.0]
