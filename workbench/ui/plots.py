"""LivePlots (one run as it trains) and CompareRuns (overlay finished runs: the backend shoot-out)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterable

import ipywidgets as W
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from workbench.ui.series import LIVE_PANELS, live_series
from workbench.ui.slim_figure import figure_widget

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


class LivePlots:
    """Tokens/s and TFLOP/s per GPU, memory per rank, loss, and expert load per layer, live.

    `attach(run)` subscribes to `Run.on_metrics` and then draws the run's own records (the run's
    one store; no copy here). Without a run, `update(records)` can be fed any list of step
    records (e.g. a finished run directory's metrics.jsonl), which the plots then keep.
    """

    def __init__(self, run: Any = None, height: int = 620) -> None:
        titles = [LIVE_PANELS[k] for k in ("tokens_per_s_per_gpu", "tflops_per_gpu", "mem_peak_gib", "loss")]
        base = make_subplots(rows=2, cols=3, subplot_titles=[*titles[:3], titles[3], "expert load (x uniform)"],
                             specs=[[{}, {}, {}], [{}, {"colspan": 2}, None]], horizontal_spacing=0.07,
                             vertical_spacing=0.14)
        self.figure = figure_widget(base)
        self.figure.update_layout(height=height, margin=dict(l=40, r=20, t=60, b=40), showlegend=True,
                                  legend=dict(orientation="h", y=1.12, x=0), template="plotly_white")
        self.figure.add_trace(go.Heatmap(z=[[0]], colorscale="RdBu_r", zmid=1.0, name="expert load",
                                         showscale=True, colorbar=dict(len=0.45, y=0.22)), row=2, col=2)
        self._heatmap = len(self.figure.data) - 1
        self._traces: dict[tuple[str, int], int] = {}
        self._records: dict[tuple[int, int], dict] = {}
        self._lock = threading.RLock()
        self._unsubscribe = None
        self.run = None
        self.title = W.HTML("<b>Live</b>: no run yet")
        self.widget = W.VBox([self.title, self.figure])
        if run is not None:
            self.attach(run)

    def attach(self, run: Any) -> None:
        """Follow `run` (a workbench Run): clear the plots and subscribe to its metrics."""
        if self._unsubscribe is not None:
            self._unsubscribe()
        with self._lock:
            self._records.clear()
        self.run = run
        self.title.value = f"<b>Live</b>: run <code>{run.run_id}</code>"
        self._unsubscribe = run.on_metrics(self.update)

    def update(self, records: Iterable[dict]) -> None:
        """Redraw; without an attached run, first merge `records` (by rank and step) into the plots' own."""
        with self._lock:
            if self.run is None:
                for r in records:
                    if "rank" in r and "step" in r:
                        self._records[(int(r["rank"]), int(r["step"]))] = r
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

    def _trace(self, metric: str, rank: int, row: int, col: int) -> int:
        key = (metric, rank)
        if key not in self._traces:
            self.figure.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name=f"rank {rank}",
                                             legendgroup=f"rank {rank}", showlegend=metric == "tokens_per_s_per_gpu",
                                             line=dict(color=COLORS[rank % len(COLORS)])), row=row, col=col)
            self._traces[key] = len(self.figure.data) - 1
        return self._traces[key]

    def _redraw(self) -> None:
        data = self.series()
        positions = {"tokens_per_s_per_gpu": (1, 1), "tflops_per_gpu": (1, 2), "mem_peak_gib": (1, 3)}
        indices = {}
        for metric, (row, col) in positions.items():
            for rank in data["per_rank"][metric]:
                indices[(metric, rank)] = self._trace(metric, rank, row, col)
        if ("loss", 0) not in self._traces and data["loss"][0]:
            self.figure.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name="loss", showlegend=False,
                                             line=dict(color="#444")), row=2, col=1)
            self._traces[("loss", 0)] = len(self.figure.data) - 1
        if ("eval_loss", 0) not in self._traces and data["eval_loss"][0]:
            self.figure.add_trace(go.Scatter(x=[], y=[], mode="lines+markers", name="eval loss", showlegend=False,
                                             line=dict(color="#d62728", dash="dash")), row=2, col=1)
            self._traces[("eval_loss", 0)] = len(self.figure.data) - 1
        with self.figure.batch_update():
            for (metric, rank), index in indices.items():
                steps, values = data["per_rank"][metric][rank]
                self.figure.data[index].x, self.figure.data[index].y = steps, values
            if ("loss", 0) in self._traces:
                trace = self.figure.data[self._traces[("loss", 0)]]
                trace.x, trace.y = data["loss"]
            if ("eval_loss", 0) in self._traces:
                trace = self.figure.data[self._traces[("eval_loss", 0)]]
                trace.x, trace.y = data["eval_loss"]
            load = data["expert_load"]
            if load["z"]:
                heat = self.figure.data[self._heatmap]
                heat.z = load["z"]
                heat.x = list(range(len(load["z"][0])))
                heat.y = [f"layer {i}" for i in range(len(load["z"]))]
                heat.hovertemplate = "expert %{x}, %{y}: %{z:.2f} x uniform<extra></extra>"
                self.figure.layout.annotations[4].text = f"expert load at step {load['step']} (x uniform)"
        if self.run is not None and getattr(self.run, "done", False):
            self.title.value = f"<b>Live</b>: run <code>{self.run.run_id}</code> {self.run.state}"

    def save_png(self, path: str | Path) -> Path:
        """Write the plots as a PNG (plotly + kaleido if it works, else matplotlib)."""
        from workbench.ui.png import save_live_png

        return save_live_png(self.figure, self.series(), Path(path))


class CompareRuns:
    """Overlay runs (run directories or Run objects): throughput, step time and loss per step."""

    def __init__(self, runs: Iterable[Any] = (), labels: Iterable[str] | None = None,
                 runs_dir: str | Path | None = None, height: int = 420) -> None:
        base = make_subplots(rows=1, cols=3, subplot_titles=["tokens/s per GPU", "step time (s)", "loss"],
                             horizontal_spacing=0.07)
        self.figure = figure_widget(base)
        self.figure.update_layout(height=height, template="plotly_white", margin=dict(l=40, r=20, t=60, b=40),
                                  legend=dict(orientation="h", y=1.18, x=0))
        self.table = W.HTML()
        self.runs_dir = Path(runs_dir).expanduser() if runs_dir else None
        self.picker = W.SelectMultiple(options=[], rows=6, description="runs", layout=W.Layout(width="60%"))
        self.refresh_button = W.Button(description="Refresh", icon="refresh")
        self.compare_button = W.Button(description="Compare", button_style="primary")
        self.refresh_button.on_click(lambda _: self.refresh())
        self.compare_button.on_click(lambda _: self.set_runs(self.picker.value))
        self.frame = None
        controls = [W.HBox([self.picker, W.VBox([self.refresh_button, self.compare_button])])] if self.runs_dir else []
        self.widget = W.VBox([W.HTML("<b>Compare runs</b>"), *controls, self.figure, self.table])
        self.refresh()
        runs = list(runs)
        if runs:
            self.set_runs(runs, labels)

    def refresh(self) -> None:
        """List the run directories under runs_dir in the picker (newest first)."""
        if self.runs_dir is None:
            return
        from workbench.runs.run_dir import list_runs

        self.picker.options = [(f"{r['id']}  {r.get('state', '?')}  {r.get('backends') or ''}"[:120], r["path"])
                               for r in list_runs(self.runs_dir) if r.get("readable")]

    def set_runs(self, runs: Iterable[Any], labels: Iterable[str] | None = None):
        """Plot these runs; returns the summary DataFrame (one row per run)."""
        from workbench.ui.series import compare_frame, summarize

        runs = list(runs)
        frame = compare_frame(runs, list(labels) if labels is not None else None)
        self.frame = frame
        with self.figure.batch_update():
            self.figure.data = []
        for i, (label, run_df) in enumerate(frame.groupby("label", sort=False)):
            per_step = run_df.groupby("step").agg(tokens=("tokens_per_s_per_gpu", "mean"),
                                                  step_time=("step_time_s", "max"), loss=("loss", "mean"))
            color = COLORS[i % len(COLORS)]
            for col, column in enumerate(("tokens", "step_time", "loss"), start=1):
                self.figure.add_trace(go.Scatter(x=list(per_step.index), y=list(per_step[column]), name=label,
                                                 legendgroup=label, showlegend=col == 1, mode="lines+markers",
                                                 line=dict(color=color)), row=1, col=col)
        summary = summarize(frame)
        self.table.value = summary.to_html(float_format=lambda v: f"{v:,.4g}", border=0)
        return summary
