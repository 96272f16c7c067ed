"""Run a prepared variant: warm-up steps, timed steps with device events, peak memory, losses."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from workbench.bench.tokens import global_batch, rank_slice
from workbench.bench.variant import Prepared
from workbench.parallel.dist_utils import collective_device
from workbench.train.metrics import memory_gib, reset_peak_memory


class _Marks:
    """Points in a step: CUDA events on GPU (no host sync between phases), host clock on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_steps(prep: Prepared, *, warmup: int, steps: int, seed: int, batch: int, seq: int, vocab_size: int,
              device: torch.device) -> dict[str, Any]:
    """Train `warmup + steps` steps on the shared synthetic batches; time the last `steps`.

    Every step ends with a device synchronize, so a step's time is its whole work; losses are
    read only after the loop (no extra host syncs inside a step).
    """
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    marks = _Marks(device)
    phases: list[tuple[float, float, float, float]] = []
    ce_parts, aux_parts = [], []
    _sync(device)
    for step in range(warmup + steps):
        if step == warmup:
            _sync(device)
            reset_peak_memory(device)
        ids = rank_slice(global_batch(step, seed, batch * world, seq, vocab_size), rank, world).to(device)
        t0 = marks.mark()
        with prep.context():
            objective, ce, aux = prep.forward(ids)
            t1 = marks.mark()
            objective.backward()
        t2 = marks.mark()
        prep.optimizer.step()
        prep.optimizer.zero_grad(set_to_none=True)
        t3 = marks.mark()
        _sync(device)
        if step >= warmup:
            phases.append((marks.seconds(t0, t3), marks.seconds(t0, t1), marks.seconds(t1, t2), marks.seconds(t2, t3)))
        ce_parts.append(ce.detach().float().reshape(()))
        aux_parts.append(aux.detach().float().reshape(()))
        del objective, ce, aux
    peak, _, mem_kind = memory_gib(device)
    return _reduce(prep.reduce, phases, ce_parts, aux_parts, peak, mem_kind, world)


def _reduce(kind: str, phases, ce_parts, aux_parts, peak: float, mem_kind: str, world: int) -> dict[str, Any]:
    """Combine ranks: slowest rank per step, global loss per step, every rank's peak memory."""
    cdev = collective_device()
    losses = torch.stack([torch.stack(ce_parts), torch.stack(aux_parts)]).double().to(cdev)
    times = torch.tensor(phases, dtype=torch.float64, device=cdev)
    peaks = torch.zeros(world, dtype=torch.float64, device=cdev)
    peaks[dist.get_rank() if dist.is_initialized() else 0] = peak
    if dist.is_initialized() and world > 1:
        dist.all_reduce(losses)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(peaks)
    if kind == "mean":
        losses = losses / world
    times, peaks, losses = times.cpu(), peaks.cpu(), losses.cpu()
    step_times = times[:, 0].tolist()
    median = statistics.median(step_times)
    return {
        "step_time_s": step_times, "median_step_s": median,
        "median_forward_s": statistics.median(times[:, 1].tolist()),
        "median_backward_s": statistics.median(times[:, 2].tolist()),
        "median_optimizer_s": statistics.median(times[:, 3].tolist()),
        "ce": losses[0].tolist(), "aux": losses[1].tolist(),
        "peak_mem_gib_per_rank": peaks.tolist(), "peak_mem_gib": float(peaks.max()), "mem_kind": mem_kind,
    }
