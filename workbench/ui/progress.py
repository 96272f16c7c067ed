"""A progress bar for a `Run`: step / total, seconds per step, ETA and state (notebook side only)."""

from __future__ import annotations

import time
from typing import Any


def format_eta(seconds: float | None) -> str:
    """'1:02:03' / '2:05' style; '?' when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    seconds = round(seconds)
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def estimate_eta(step_times: list[float], steps_done: int, total_steps: int | None) -> float | None:
    """Remaining seconds from the median of recent step times (robust to the slow first step)."""
    if not total_steps or not step_times:
        return None
    recent = sorted(step_times[-20:])
    median = recent[len(recent) // 2]
    return max(0, total_steps - steps_done) * median


class RunProgress:
    """Owns the widget and keeps it in step with the run through `Run.on_metrics`."""

    def __init__(self, run: Any) -> None:
        import ipywidgets as widgets  # lazy: the engines never import this module

        self.run = run
        self.total = run.total_steps
        # No run id as the bar's description and a label as wide as its text: a fixed width cut both
        # off ("-084846-…", "completed at step 4/4 (("); the row wraps on a narrow notebook instead.
        self.bar = widgets.IntProgress(
            value=0, min=0, max=self.total or 1, layout=widgets.Layout(flex="1 1 200px", min_width="120px")
        )
        self.label = widgets.Label(value=f"{run.state}", layout=widgets.Layout(flex="0 0 auto", width="auto"))
        self.widget = widgets.HBox(
            [self.bar, self.label], layout=widgets.Layout(flex_flow="row wrap", align_items="center", width="100%")
        )
        self._step_times: list[float] = []
        self._started = time.monotonic()
        run.on_metrics(self._update)

    def _update(self, records: list[dict]) -> None:
        for record in records:
            if record.get("rank", 0) == 0 and record.get("step_time_s") is not None:
                self._step_times.append(float(record["step_time_s"]))
        if self.total is None:
            self.total = self.run.total_steps
            if self.total:
                self.bar.max = self.total
        step = self.run.last_step or 0
        self.bar.value = min(step, self.bar.max)
        state = self.run.state
        if self.run.done:
            self.bar.bar_style = {"completed": "success", "stopped": "warning", "failed": "danger"}.get(state, "")
            elapsed = time.monotonic() - self._started
            self.label.value = f"{state} at step {step}/{self.total or '?'} ({format_eta(elapsed)})"
            return
        per_step = sorted(self._step_times[-20:])[len(self._step_times[-20:]) // 2] if self._step_times else None
        eta = estimate_eta(self._step_times, step, self.total)
        speed = f"{per_step:.2f} s/step" if per_step is not None else "? s/step"
        self.label.value = f"step {step}/{self.total or '?'} · {speed} · ETA {format_eta(eta)} · {state}"
