"""A terminal progress bar for a run: a trainer callback that draws tqdm's bar with ETA and the live figures.

The `workbench` command adds it on rank 0 when stdout is a terminal (or with `--progress bar`);
elsewhere (CI, pipes, notebooks) the trainer's plain line per logging step stays, so logs read
line by line. tqdm comes with Transformers (and is a direct dependency for this module).
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import IO, Any

BAR_LABEL_CHARS = 40
FALLBACK_COLUMNS = 160  # for a terminal that reports no size (a new pty: 0 x 0), where tqdm would draw nothing


def bar_label(info: dict[str, Any]) -> str:
    """The bar's label: the run's name (RunConfig.name) where it has one, else its id; cut to BAR_LABEL_CHARS,
    since the bar is one terminal line (the summary after the run names it in full)."""
    config = info.get("config") if isinstance(info.get("config"), dict) else {}
    label = str(config.get("name") or info.get("run_id") or "run")
    return label if len(label) <= BAR_LABEL_CHARS else label[: BAR_LABEL_CHARS - 3] + "..."


def live_figures(record: dict[str, Any], eval_loss: float | None = None) -> str:
    """The bar's postfix for one step record: loss, tokens/s and TFLOP/s per GPU, peak memory, eval loss."""
    parts = [
        f"loss {record['loss']:.4f}",
        f"{record['tokens_per_s_per_gpu']:,.0f} tok/s/gpu",
        f"{record['tflops_per_gpu']:.3g} TFLOP/s/gpu",
    ]
    if record.get("mem_peak_gib") is not None:
        parts.append(f"peak {record['mem_peak_gib']:.2f} GiB")
    if eval_loss is not None:
        parts.append(f"eval {eval_loss:.4f}")
    return " | ".join(parts)


class ProgressBar:
    """Trainer callback for rank 0: one bar over the run's steps; the trainer then prints no step lines."""

    prints_step_lines = True  # the trainer leaves its per-step lines to this callback

    def __init__(self, file: IO[str] | None = None) -> None:
        self.file = file
        self.bar: Any = None
        self.eval_loss: float | None = None

    def on_start(self, info: dict[str, Any]) -> None:
        from tqdm import tqdm

        file = self.file or sys.stdout
        # tqdm's ETA is a smoothed rate, so the first step's warm-up (compilation, allocation) fades out of it.
        # Every record redraws (mininterval=0): at most one per step.
        self.bar = tqdm(
            total=info["total_steps"],
            initial=info["start_step"],
            unit="step",
            desc=bar_label(info),
            file=file,
            smoothing=0.3,
            mininterval=0,
            leave=True,
            **_screen(file),
        )

    def on_step(self, record: dict[str, Any]) -> None:
        if self.bar is None:
            return
        if record.get("eval_loss") is not None:
            self.eval_loss = float(record["eval_loss"])
        self.bar.set_postfix_str(live_figures(record, self.eval_loss), refresh=False)
        self.bar.update(max(0, int(record["step"]) - self.bar.n))

    def on_end(self, result: dict[str, Any]) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _screen(file: IO[str]) -> dict[str, Any]:
    """tqdm's size arguments: follow the terminal when it reports a size, else $COLUMNS/$LINES or a fallback."""
    try:
        size = os.get_terminal_size(file.fileno())
        if size.columns > 0 and size.lines > 0:
            return {"dynamic_ncols": True}
    except (AttributeError, OSError, ValueError):  # not a terminal, or no file descriptor
        pass
    # tqdm takes a size of 0 as given: 0 columns draw an empty bar and 0 lines hide it
    columns, lines = shutil.get_terminal_size((FALLBACK_COLUMNS, 24))
    return {"ncols": columns, "nrows": lines}
