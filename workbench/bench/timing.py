"""The run order of a launch (alternating rounds) and the statistics of the Trainer's step records."""

from __future__ import annotations

import statistics
from typing import Any

import torch
import torch.distributed as dist

from workbench.parallel.dist_utils import collective_device, rank

PHASES = ("step_time_s", "forward_s", "backward_s", "optimizer_s")


def round_orders(names: list[str] | tuple[str, ...], rounds: int) -> list[list[str]]:
    """Variants per round: in order, reversed, in order, ... (ABC CBA ABC): a slow drift of the machine
    (clocks, temperature, allocator state) then weighs on every variant alike."""
    return [list(names) if r % 2 == 0 else list(reversed(names)) for r in range(rounds)]


def split_steps(steps: int, rounds: int) -> list[int]:
    """Timed steps per round, as even as they go (the first rounds take the remainder)."""
    base, extra = divmod(steps, rounds)
    return [base + (1 if r < extra else 0) for r in range(rounds)]


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation between the closest ranks."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _peak(record: dict[str, Any]) -> float:
    return float(record.get("peak_mem_gib", record.get("mem_peak_gib", 0.0)))


def combine_rounds(rounds: list[list[dict[str, Any]]], warmup: int, world: int) -> dict[str, Any]:
    """One variant's numbers from this rank's records of every round (collective over the ranks).

    The first `warmup` records of each round are not timed. A step's time is the slowest rank's;
    the peak memory is each rank's highest over the timed steps; the losses are the Trainer's
    global ones (equal on every rank). The loss curve is the first round's (every round starts from
    the same weights and tokens).
    """
    timed = [recs[warmup:] for recs in rounds]
    counts = [len(t) for t in timed]
    if not all(counts):
        raise RuntimeError(f"a round returned no timed step records (counts per round {counts}, warmup {warmup})")
    cdev = collective_device()
    times = torch.tensor([[float(r[k]) for k in PHASES] for t in timed for r in t], dtype=torch.float64, device=cdev)
    peaks = torch.zeros(world, dtype=torch.float64, device=cdev)
    peaks[rank()] = max(_peak(r) for t in timed for r in t)
    if dist.is_initialized() and world > 1:
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        dist.all_reduce(peaks)
    times, peaks = times.cpu(), peaks.cpu()
    step = times[:, 0].tolist()
    per_round, at = [], 0
    for n in counts:
        per_round.append(step[at : at + n])
        at += n
    median = statistics.median(step)
    return {
        "step_time_s": step,
        "round_step_time_s": per_round,
        "median_step_s": median,
        "p10_step_s": percentile(step, 10),
        "p90_step_s": percentile(step, 90),
        **{f"median_{k}": statistics.median(times[:, i].tolist()) for i, k in enumerate(PHASES) if i},
        "loss": [float(r["loss"]) for r in rounds[0]],
        "round_loss": [[float(r["loss"]) for r in recs] for recs in rounds],
        "grad_norm": [float(r["grad_norm"]) for r in rounds[0]],
        "peak_mem_gib_per_rank": peaks.tolist(),
        "peak_mem_gib": float(peaks.max()),
        "mem_kind": rounds[0][0].get("mem_kind"),
    }
