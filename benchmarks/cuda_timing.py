"""Median milliseconds of a GPU callable by CUDA events: the one timer of the benchmark scripts."""

from __future__ import annotations

import statistics

import torch


def cuda_event_ms(fn, reps: int) -> float:
    """Median milliseconds of `fn()` over `reps` runs, each bracketed by CUDA events."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)
