"""The trainer's callback that reports each step record to the trackers train.report_to names (rank 0 only).

Added by workbench.train.loop.Trainer beside the user's callbacks, so it sees every record once, in step order,
right after it is written to metrics.jsonl; it opens the trackers when the run starts (inside the run's folder)
and closes them with the run's end state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.trackers.registry import Tracker, open_tracker
from workbench.trackers.scalars import step_scalars


class TrackerReport:
    """Callback: on_start opens the trackers, on_step logs a record's numbers, on_end closes them."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.trackers: list[Tracker] = []

    def on_start(self, info: dict[str, Any]) -> None:
        config = info["config"]
        run_name = config.get("name") or info["run_id"]
        for name in self.names:
            self.trackers.append(open_tracker(name, Path(info["run_dir"]), run_name, config))

    def on_step(self, record: dict[str, Any]) -> None:
        scalars = step_scalars(record)
        for tracker in self.trackers:
            tracker.log(scalars, record["step"])

    def on_end(self, result: dict[str, Any]) -> None:
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.close(result.get("state", "failed"))
