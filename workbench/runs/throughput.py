"""A run's tokens/s per GPU: one definition, read the same by `workbench runs`, `workbench show`, the
Studio (Live strip, Compare list and table) and the lab's sidebar.

The figure is the median, over the latest THROUGHPUT_WINDOW complete steps (steps every rank has
reported), of each step's mean over ranks of the records' `tokens_per_s_per_gpu`; the run's first step
(allocation, compilation: the warm-up) is left out unless it is the only one.

Why this one: a median of recent steps is the speed the run goes at now, which a live run needs and a
finished one keeps; one slow step (an eval, a checkpoint save, a garbage collection) does not move it,
where a mean over the run or the last step alone would jump; and it needs only the end of a metrics file,
so listing a folder with a 1 GB metrics file still reads kilobytes (workbench.runs.run_index).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from typing import Any

THROUGHPUT_WINDOW = 10  # steps the median is over
THROUGHPUT_KEY = "tokens_per_s_per_gpu"
THROUGHPUT_RULE = (
    f"median over the latest {THROUGHPUT_WINDOW} steps of the ranks' mean tokens/s per GPU, the first step "
    "(warm-up) left out"
)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class StepThroughput:
    """The run's tokens/s per GPU, taken one record at a time (any order of ranks within a step): holds the
    values of at most THROUGHPUT_WINDOW + 1 steps, however long the run."""

    def __init__(self, key: str = THROUGHPUT_KEY, window: int = THROUGHPUT_WINDOW) -> None:
        self.key = key
        self.window = window
        self.first_step: int | None = None  # the lowest step seen: the warm-up when later steps exist
        self.ranks: set[int] = set()
        self.steps: dict[int, dict[int, float]] = {}  # step -> rank -> value, of the latest steps only

    def add(self, record: dict[str, Any]) -> None:
        step, rank, value = record.get("step"), record.get("rank", 0), record.get(self.key)
        if not (_is_int(step) and _is_int(rank) and _is_number(value)):
            return
        self.ranks.add(rank)
        if self.first_step is None or step < self.first_step:
            self.first_step = step
        self.steps.setdefault(step, {})[rank] = float(value)
        # Keep one step more than the window: the latest step may still be incomplete (ranks writing).
        while len(self.steps) > self.window + 2:
            del self.steps[min(self.steps)]

    def window_steps(self) -> list[int]:
        """The steps the figure is the median over (ascending)."""
        complete = sorted(s for s, by_rank in self.steps.items() if set(by_rank) == self.ranks)
        steady = [s for s in complete if s != self.first_step] or complete
        return steady[-self.window :]

    def value(self) -> float | None:
        """The run's tokens/s per GPU (None before any complete step)."""
        steps = self.window_steps()
        if not steps:
            return None
        return statistics.median(statistics.fmean(self.steps[s].values()) for s in steps)


def run_throughput(records: Iterable[dict[str, Any]], key: str = THROUGHPUT_KEY) -> float | None:
    """The run's `key` per GPU from its step records (every rank's): see the module's definition."""
    figure = StepThroughput(key)
    for record in records:
        figure.add(record)
    return figure.value()
