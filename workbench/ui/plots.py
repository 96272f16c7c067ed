"""LivePlots (one run as it trains) and CompareRuns (overlay finished runs: the backend shoot-out)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.runs.run_index import list_runs
from workbench.ui.moe_health_plot import MoEHealthPlots
from workbench.ui.png import save_live_png
from workbench.ui.run_title import run_config_of, run_title_html
from workbench.ui.series import (
    LIVE_PANELS,
    axis_range,
    compare_frame,
    ema,
    live_series,
    load_color_range,
    load_colorscale,
    run_list_label,
    split_warmup,
    summarize,
)
from workbench.ui.slim_figure import figure_widget
from workbench.ui.step_ticks import step_dtick

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")
# Time-based panels: their first step (compile, allocation) is drawn apart and kept off the axis scale.
WARMUP_APART = ("tokens_per_s_per_gpu", "tflops_per_gpu")
POSITIONS = {"tokens_per_s_per_gpu": (1, 1), "tflops_per_gpu": (1, 2), "mem_peak_gib": (1, 3)}
# The axes of steps (the top row and the loss), named as plotly's layout names them.
STEP_AXES = ("xaxis", "xaxis2", "xaxis3", "xaxis4")
# Where the expert-load heatmap ends (figure width 0..1): its colour bar goes right of it, inside the figure.
HEATMAP_RIGHT = 0.9


class LivePlots:
    """Tokens/s and TFLOP/s per GPU, memory per rank, loss, and expert load per layer, live.

    `attach(run)` subscribes to `Run.on_metrics` and then draws the run's own records (the run's
    one store; no copy here). Without a run, `update(records)` can be fed any list of step
    records (e.g. a finished run directory's metrics.jsonl), which the plots then keep.
    """

    def __init__(self, run: Any = None, height: int = 780) -> None:
        self._titles = [
            *(LIVE_PANELS[k] for k in ("tokens_per_s_per_gpu", "tflops_per_gpu", "mem_peak_gib", "loss")),
            "expert load (x uniform)",
        ]
        base = make_subplots(
            rows=2,
            cols=3,
            subplot_titles=self._titles,
            specs=[[{}, {}, {}], [{}, {"colspan": 2}, None]],
            horizontal_spacing=0.08,
            vertical_spacing=0.16,
        )
        self.figure = figure_widget(base)
        # The legend sits under the plots: above them it ran into the subplot titles.
        self.figure.update_layout(
            height=height,
            margin=dict(l=50, r=20, t=60, b=70),
            showlegend=True,
            legend=dict(orientation="h", y=-0.08, yanchor="top", x=0),
            template="plotly_white",
        )
        low, high = load_color_range([])
        self.figure.add_trace(
            go.Heatmap(
                z=[[0]],
                colorscale=load_colorscale(high),
                zmin=low,
                zmax=high,
                name="expert load",
                showscale=True,
                showlegend=False,
                # Inside the figure, right of the heatmap: a colour bar beyond the plots widened the right
                # margin of the whole figure and left a fifth of the top row's width empty.
                colorbar=dict(len=0.42, y=0.21, x=1.0, xanchor="right", thickness=14, title="x uniform"),
            ),
            row=2,
            col=2,
        )
        self._heatmap = len(self.figure.data) - 1
        heat_x = self.figure.get_subplot(2, 2).xaxis
        heat_x.domain = [heat_x.domain[0], HEATMAP_RIGHT]
        self.smoothing = W.FloatSlider(
            value=0.0,
            min=0.0,
            max=0.95,
            step=0.05,
            description="loss smoothing",
            style={"description_width": "initial"},
            readout_format=".2f",
            layout=W.Layout(width="320px"),
        )
        self.smoothing.observe(lambda _: self.update([]), "value")
        self._traces: dict[tuple[str, int], int] = {}
        self._records: dict[tuple[int, int], dict] = {}
        self._lock = threading.RLock()
        self._unsubscribe = None
        self.min_redraw_s = 1.0
        self._last_redraw = 0.0
        self._pending: threading.Timer | None = None
        self.run = None
        self.title = W.HTML("<b>Live</b>: no run yet")
        # The warm-up step's values that left the scales: a line of their own (as subplot subtitles they
        # ran into the next plot's title on a narrow figure).
        self.warmup_note = W.HTML("", layout=W.Layout(display="none"))
        self.health = MoEHealthPlots()  # small multiples of the MoE health per layer, under the heatmap
        self.widget = W.VBox([self.title, self.smoothing, self.warmup_note, self.figure, self.health.widget])
        if run is not None:
            self.attach(run)

    def attach(self, run: Any) -> None:
        """Follow `run` (a workbench Run): clear the plots and subscribe to its metrics."""
        if self._unsubscribe is not None:
            self._unsubscribe()
        with self._lock:
            self._records.clear()
        self.run = run
        self.title.value = f"<b>Live</b>: run {run_title_html(run.run_id, run_config_of(run))}"
        self._unsubscribe = run.on_metrics(self.update)

    def update(self, records: Iterable[dict]) -> None:
        """Redraw; without an attached run, first merge `records` (by rank and step) into the plots' own.

        While an attached run goes, redraws come at most every `min_redraw_s` (1 s; each one sends every
        line to the browser: at the watcher's 10 per second a fast run kept the page busy); the
        last records are drawn when the run ends, or `min_redraw_s` after they came.
        """
        with self._lock:
            if self.run is None:
                for r in records:
                    if "rank" in r and "step" in r:
                        self._records[(int(r["rank"]), int(r["step"]))] = r
            elif not getattr(self.run, "done", True):
                wait = self._last_redraw + self.min_redraw_s - time.monotonic()
                if wait > 0:
                    if self._pending is None:
                        self._pending = threading.Timer(wait, self._flush)
                        self._pending.daemon = True
                        self._pending.start()
                    return
            if self._pending is not None:
                self._pending.cancel()
                self._pending = None
            self._last_redraw = time.monotonic()
            self._redraw()

    def _flush(self) -> None:
        with self._lock:
            self._pending = None
            self._last_redraw = time.monotonic()
            self._redraw()

    @property
    def records(self) -> list[dict]:
        """The records drawn: the attached run's, else those given to `update`."""
        if self.run is not None:
            return self.run.records
        with self._lock:
            return [self._records[k] for k in sorted(self._records, key=lambda k: (k[1], k[0]))]

    def series(self) -> dict[str, Any]:
        """The plotted data (see workbench.ui.series.live_series)."""
        return live_series(self.records)

    def _trace(self, metric: str, rank: int, row: int, col: int, warmup: bool = False) -> int:
        key = (f"{metric}:warmup" if warmup else metric, rank)
        if key not in self._traces:
            color = COLORS[rank % len(COLORS)]
            if warmup:  # a hollow marker, not joined to the line: the step is shown, apart from the rest
                trace = go.Scatter(
                    x=[],
                    y=[],
                    mode="markers",
                    name=f"warm-up step, rank {rank}",
                    legendgroup="warm-up",
                    showlegend=False,
                    hovertemplate=("warm-up step %{x}: %{y:,.4g}<extra>rank " + str(rank) + "</extra>"),
                    marker=dict(color=color, symbol="circle-open", size=9),
                )
            else:
                trace = go.Scatter(
                    x=[],
                    y=[],
                    mode="lines+markers",
                    name=f"rank {rank}",
                    legendgroup=f"rank {rank}",
                    showlegend=metric == "tokens_per_s_per_gpu",
                    line=dict(color=color),
                )
            self.figure.add_trace(trace, row=row, col=col)
            self._traces[key] = len(self.figure.data) - 1
        return self._traces[key]

    def _line(self, key: str, name: str, color: str, dash: str | None = None) -> int:
        if (key, 0) not in self._traces:
            self.figure.add_trace(
                go.Scatter(
                    x=[],
                    y=[],
                    mode="lines+markers" if dash != "dot" else "lines",
                    name=name,
                    showlegend=False,
                    line=dict(color=color, dash=dash),
                ),
                row=2,
                col=1,
            )
            self._traces[(key, 0)] = len(self.figure.data) - 1
        return self._traces[(key, 0)]

    def _redraw(self) -> None:
        data = self.series()
        warm = data["warmup_step"]
        lines: dict[int, tuple[list, list]] = {}
        ranges: dict[str, list[float] | None] = {}
        off_scale: dict[str, list[float]] = {}
        for metric, (row, col) in POSITIONS.items():
            steady_values: list[float] = []
            for rank, (steps, values) in data["per_rank"][metric].items():
                apart = metric in WARMUP_APART and warm is not None
                (s_steps, s_values), (w_steps, w_values) = split_warmup(steps, values, warm if apart else None)
                lines[self._trace(metric, rank, row, col)] = (s_steps, s_values)
                steady_values += s_values
                if w_steps:
                    lines[self._trace(metric, rank, row, col, warmup=True)] = (w_steps, w_values)
                    off_scale.setdefault(metric, []).extend(w_values)
            if metric in WARMUP_APART and warm is not None:
                ranges[metric] = axis_range(steady_values)
        if data["loss"][0]:
            lines[self._line("loss", "loss", "#444")] = data["loss"]
            weight = float(self.smoothing.value)
            if weight:
                lines[self._line("loss_smoothed", "loss (smoothed)", "#1f77b4", "dot")] = (
                    data["loss"][0],
                    ema(data["loss"][1], weight),
                )
            elif ("loss_smoothed", 0) in self._traces:
                lines[self._traces[("loss_smoothed", 0)]] = ([], [])
        if data["eval_loss"][0]:
            lines[self._line("eval_loss", "eval loss", "#d62728", "dash")] = data["eval_loss"]
        with self.figure.batch_update():
            for index, (x, y) in lines.items():
                self.figure.data[index].x, self.figure.data[index].y = x, y
            notes = []
            for n, metric in enumerate(POSITIONS):
                axis = self.figure.layout[f"yaxis{n + 1 if n else ''}"]
                rng = ranges.get(metric)
                axis.range, axis.autorange = (rng, False) if rng else (None, True)
                outside = [v for v in off_scale.get(metric, []) if rng and not rng[0] <= v <= rng[1]]
                if outside:  # the warm-up value left the scale: say what it was
                    notes.append(f"{self._titles[n]} {min(outside):,.4g}")
            self.warmup_note.value = (
                f"<span class='mwb-warmup-note' style='color:#555'>warm-up step {warm}, drawn apart and off the "
                f"scale: {' &middot; '.join(notes)}</span>"
                if notes
                else ""
            )
            self.warmup_note.layout.display = "" if notes else "none"
            steps = [r["step"] for r in self.records if isinstance(r.get("step"), int)]
            if steps:
                dtick = step_dtick(min(steps), max(steps))
                for name in STEP_AXES:
                    self.figure.layout[name].update(tick0=0, dtick=dtick)
            load = data["expert_load"]
            if load["z"]:
                heat = self.figure.data[self._heatmap]
                low, high = load_color_range(load["z"])
                heat.z, heat.zmin, heat.zmax, heat.colorscale = load["z"], low, high, load_colorscale(high)
                heat.x = list(range(len(load["z"][0])))
                heat.y = [f"layer {i}" for i in range(len(load["z"]))]
                heat.hovertemplate = "expert %{x}, %{y}: %{z:.2f} x uniform<extra></extra>"
                self.figure.layout.annotations[4].text = f"expert load at step {load['step']} (x uniform)"
        self.health.draw(self.records)
        if self.run is not None and getattr(self.run, "done", False):
            title = run_title_html(self.run.run_id, run_config_of(self.run))
            self.title.value = f"<b>Live</b>: run {title} {self.run.state}"

    def save_png(self, path: str | Path) -> Path:
        """Write the plots as a PNG (plotly + kaleido if it works, else matplotlib)."""
        return save_live_png(self.figure, self.series(), Path(path))


EMPTY_BEFORE = (
    "No runs compared yet. Select one or more runs in the list above (Ctrl- or Shift-click for "
    "several) and press <b>Compare</b>; finished runs appear after <b>Refresh</b>."
)
EMPTY_NONE_SELECTED = (
    "No run selected. Select one or more runs in the list above (Ctrl- or Shift-click for "
    "several), then press <b>Compare</b>."
)
EMPTY_NO_RUNS = "No runs in {where} yet: start one in the Setup tab, then press <b>Refresh</b>."


def _empty_html(text: str) -> str:
    return (
        f"<div class='mwb-empty' style='padding:24px;color:#555;border:1px dashed #bbb;border-radius:4px'>{text}</div>"
    )


class CompareRuns:
    """Overlay runs (run directories or Run objects): throughput, step time and loss per step."""

    def __init__(
        self,
        runs: Iterable[Any] = (),
        labels: Iterable[str] | None = None,
        runs_dir: str | Path | None = None,
        height: int = 460,
    ) -> None:
        base = make_subplots(
            rows=1, cols=3, subplot_titles=["tokens/s per GPU", "step time (s)", "loss"], horizontal_spacing=0.08
        )
        self.figure = figure_widget(base)
        # The legend sits under the plots: above them it ran into the subplot titles.
        self.figure.update_layout(
            height=height,
            template="plotly_white",
            margin=dict(l=50, r=20, t=50, b=40),
            legend=dict(orientation="h", y=-0.14, yanchor="top", x=0),
        )
        self.table = W.HTML()
        self.empty = W.HTML()
        self.runs_dir = Path(runs_dir).expanduser() if runs_dir else None
        self.picker = W.SelectMultiple(options=[], rows=6, layout=W.Layout(flex="1 1 480px", min_width="260px"))
        self.refresh_button = W.Button(description="Refresh", icon="refresh", layout=W.Layout(width="auto"))
        self.compare_button = W.Button(description="Compare", button_style="primary", layout=W.Layout(width="auto"))
        self.refresh_button.on_click(lambda _: self.refresh())
        self.compare_button.on_click(lambda _: self.compare_selected())
        self.frame = None
        controls = (
            [
                W.HBox(
                    [self.picker, W.VBox([self.refresh_button, self.compare_button])],
                    layout=W.Layout(flex_flow="row wrap"),
                )
            ]
            if self.runs_dir
            else []
        )
        self.plots = W.VBox([self.figure, self.table])
        self.widget = W.VBox([W.HTML("<b>Compare runs</b>"), *controls, self.empty, self.plots])
        self._show_empty(EMPTY_BEFORE)
        self.refresh()
        runs = list(runs)
        if runs:
            self.set_runs(runs, labels)

    def _show_empty(self, text: str | None) -> None:
        """Show `text` in place of the plots (None: show the plots)."""
        self.empty.value = _empty_html(text) if text else ""
        self.empty.layout.display = "" if text else "none"
        self.plots.layout.display = "none" if text else ""

    def refresh(self) -> None:
        """List the run directories under runs_dir in the picker (newest first)."""
        if self.runs_dir is None:
            return
        runs = [r for r in list_runs(self.runs_dir) if r.get("readable")] if self.runs_dir.is_dir() else []
        self.picker.options = [(run_list_label(r), r["path"]) for r in runs]
        if not runs and self.frame is None:
            self._show_empty(EMPTY_NO_RUNS.format(where=f"<code>{self.runs_dir}</code>"))
        elif self.frame is None:
            self._show_empty(EMPTY_BEFORE)

    def compare_selected(self):
        """Plot the runs selected in the list; with none selected, say what to do."""
        if not self.picker.value:
            self.frame = None
            self._show_empty(EMPTY_NONE_SELECTED)
            return None
        return self.set_runs(self.picker.value)

    def set_runs(self, runs: Iterable[Any], labels: Iterable[str] | None = None):
        """Plot these runs; returns the summary DataFrame (one row per run)."""
        runs = list(runs)
        frame = compare_frame(runs, list(labels) if labels is not None else None)
        self.frame = frame
        with self.figure.batch_update():
            self.figure.data = []
        for i, (label, run_df) in enumerate(frame.groupby("label", sort=False)):
            per_step = run_df.groupby("step").agg(
                tokens=("tokens_per_s_per_gpu", "mean"), step_time=("step_time_s", "max"), loss=("loss", "mean")
            )
            color = COLORS[i % len(COLORS)]
            for col, column in enumerate(("tokens", "step_time", "loss"), start=1):
                self.figure.add_trace(
                    go.Scatter(
                        x=list(per_step.index),
                        y=list(per_step[column]),
                        name=label,
                        legendgroup=label,
                        showlegend=col == 1,
                        mode="lines+markers",
                        line=dict(color=color),
                    ),
                    row=1,
                    col=col,
                )
        dtick = step_dtick(int(frame["step"].min()), int(frame["step"].max()))
        for name in ("xaxis", "xaxis2", "xaxis3"):
            self.figure.layout[name].update(tick0=0, dtick=dtick)
        summary = summarize(frame)
        table = summary.to_html(float_format=lambda v: f"{v:,.4g}", border=0)
        cell = "style='padding:2px 10px;text-align:right;white-space:nowrap'"
        self.table.value = (
            "<div style='overflow-x:auto;font-size:12px'>"
            + table.replace("<td>", f"<td {cell}>").replace("<th>", f"<th {cell}>")
            + "</div>"
        )
        self._show_empty(None)
        return summary
