"""ProfilePanel: profile N steps on every rank, chart the per-phase breakdown, offer the traces."""

from __future__ import annotations

import base64
import gzip
import html
import json
from pathlib import Path
from typing import Any

import ipywidgets as W
import plotly.graph_objects as go

from workbench.config import ConfigError
from workbench.ui.plots import COLORS
from workbench.ui.slim_figure import figure_widget

PROFILE_TARGET = "workbench.train.profile:profile_finetune"
# Traces bigger than this (gzipped) are offered by path only: a data URI that size stalls the browser.
MAX_INLINE_TRACE_BYTES = 25 << 20
PROFILE_EMPTY = (
    "<div class='mwb-empty' style='padding:24px;color:#555;border:1px dashed #bbb;border-radius:4px'>"
    "No profile yet. Press <b>Profile</b> to run the Setup tab's run for the profiled steps (plus one "
    "warm-up step) with torch.profiler on every rank: the time per phase (router, dispatch, "
    "experts, combine, communication), the top ops and each rank's trace appear here.</div>"
)


def load_profile(run_dir: str | Path) -> list[dict]:
    """The phases_rank*.json records of a profiled run, ordered by rank."""
    folder = Path(run_dir).expanduser() / "profile"
    files = sorted(folder.glob("phases_rank*.json"), key=lambda p: int(p.stem.removeprefix("phases_rank")))
    if not files:
        raise FileNotFoundError(
            f"no profile in {folder}: run it with target={PROFILE_TARGET!r} "
            "(ProfilePanel.profile does) and let at least 2 steps finish"
        )
    return [json.loads(p.read_text()) for p in files]


def breakdown_frame(profiles: list[dict]):
    """A DataFrame of milliseconds per step: one row per phase (communication last), one column per rank."""
    import pandas as pd

    rows: dict[str, dict[str, float]] = {}
    for prof in profiles:
        col = f"rank {prof['rank']}"
        for phase, ms in prof["phases_ms"].items():
            rows.setdefault(phase, {})[col] = ms
        rows.setdefault("communication", {})[col] = prof["communication_ms"]
    return pd.DataFrame.from_dict(rows, orient="index")


def breakdown_figure(profiles: list[dict]) -> go.Figure:
    """Grouped bars: milliseconds per step of each phase, one bar per rank."""
    frame = breakdown_frame(profiles)
    unit = "device" if profiles and profiles[0].get("device") == "cuda" else "CPU"
    fig = go.Figure()
    for i, col in enumerate(frame.columns):
        fig.add_bar(x=list(frame.index), y=list(frame[col]), name=col, marker_color=COLORS[i % len(COLORS)])
    fig.update_layout(
        barmode="group",
        template="plotly_white",
        height=380,
        yaxis_title=f"{unit} ms per step",
        title=f"per-phase time ({profiles[0]['steps'] if profiles else '?'} profiled steps; "
        "phases nest, communication overlaps them)",
        margin=dict(l=50, r=20, t=60, b=40),
    )
    return fig


def trace_links(profiles: list[dict]) -> str:
    """HTML: a download link per rank's Chrome trace (gzipped data URI when small), and its path."""
    items = []
    for prof in profiles:
        path = Path(prof["trace"])
        if not path.exists():
            items.append(f"rank {prof['rank']}: trace missing at {html.escape(str(path))}")
            continue
        data = gzip.compress(path.read_bytes())
        link = ""
        if len(data) <= MAX_INLINE_TRACE_BYTES:
            uri = "data:application/gzip;base64," + base64.b64encode(data).decode()
            link = f"<a download='{path.stem}.json.gz' href='{uri}'>download {path.stem}.json.gz</a> "
        items.append(f"rank {prof['rank']}: {link}<code>{html.escape(str(path))}</code>")
    return "<b>Traces</b> (open in ui.perfetto.dev or chrome://tracing):<br>" + "<br>".join(items) if items else ""


class ProfilePanel:
    """Profile N steps of a run on all ranks; show the per-phase chart, the top ops and the traces.

    `config_fn()` gives the RunConfig to profile (e.g. Studio's current setup); its steps are set
    to 1 warm-up step + N profiled steps and no checkpoint is written.
    """

    def __init__(self, cluster: Any = None, config_fn: Any = None, steps: int = 3) -> None:
        self.cluster, self.config_fn = cluster, config_fn
        self.steps = W.BoundedIntText(
            value=steps,
            min=1,
            max=100,
            description="profiled steps",
            style={"description_width": "initial"},
            layout=W.Layout(width="auto"),
        )
        self.button = W.Button(
            description="Profile", icon="tachometer", button_style="info", layout=W.Layout(width="auto")
        )
        self.status = W.HTML()
        self.empty = W.HTML(PROFILE_EMPTY)
        self.figure = figure_widget(go.Figure(layout=dict(template="plotly_white", height=380)))
        self.links = W.HTML()
        self.top = W.HTML()
        self.run = None
        self.profiles: list[dict] = []
        self._listeners: list[Any] = []
        self.button.on_click(lambda _: self._clicked())
        self.results = W.VBox([self.figure, self.links, self.top], layout=W.Layout(display="none"))
        self.widget = W.VBox(
            [
                W.HTML("<b>Profile</b>: torch.profiler on every rank (first step skipped)"),
                W.HBox([self.steps, self.button], layout=W.Layout(flex_flow="row wrap")),
                self.status,
                self.empty,
                self.results,
            ]
        )

    def _clicked(self) -> None:
        try:
            self.profile()
        except (ConfigError, ValueError, TypeError, RuntimeError, FileExistsError) as err:  # say it in the tab
            self.button.disabled = False
            self.status.value = f"<span style='color:#b00020'>{html.escape(str(err))}</span>"

    def on_run(self, fn: Any) -> None:
        """Call fn(run) for every profiled run this panel starts."""
        self._listeners.append(fn)

    def profile(self, config: Any = None, wait: bool = False):
        """Start a profiled run of N steps (plus one warm-up); shows results when it ends."""
        if self.cluster is None:
            raise RuntimeError("ProfilePanel needs a cluster: ProfilePanel(cluster, config_fn)")
        if config is None:
            if self.config_fn is None:
                raise RuntimeError("give a RunConfig, or build the panel with config_fn")
            config = self.config_fn()
        config = config.with_overrides(
            {
                "train.steps": self.steps.value + 1,
                "train.save_final_checkpoint": False,
                "train.checkpoint_every": None,
                "run_id": None,
            }
        )
        self.run = self.cluster.finetune(config, target=PROFILE_TARGET)
        self.profiles = []
        self.button.disabled = True  # one profile at a time; enabled again when it ends
        self.status.value = f"profiling run <code>{self.run.run_id}</code> ..."
        self.run.on_metrics(lambda _: self._maybe_show())
        for fn in list(self._listeners):
            fn(self.run)
        if wait:
            self.run.wait()
            self._maybe_show()
        return self.run

    def _maybe_show(self) -> None:
        if self.run is not None and self.run.done and not self.profiles:
            self.button.disabled = False
            if self.run.state != "completed":
                self.status.value = f"profiling run {self.run.state}: {html.escape(str(self.run.error or ''))[:2000]}"
                return
            self.show(self.run.path)

    def show(self, run_dir: str | Path) -> list[dict]:
        """Load and display the profile of a run directory; returns the per-rank records."""
        self.profiles = load_profile(run_dir)
        fig = breakdown_figure(self.profiles)
        self.figure.data = []
        self.figure.add_traces(list(fig.data))
        self.figure.update_layout(fig.layout.to_plotly_json())
        self.links.value = trace_links(self.profiles)
        self.empty.layout.display, self.results.layout.display = "none", ""
        top = self.profiles[0]["top_ops"][:10]
        self.top.value = "<b>Top ops on rank 0</b> (self ms per step)<br>" + "<br>".join(
            f"{op['self_ms']:.2f} ms &nbsp; {html.escape(op['name'])} ({op['calls']} calls)" for op in top
        )
        missing = sorted({p for prof in self.profiles for p in prof.get("missing_phases", [])})
        self.status.value = f"profiled {self.profiles[0]['steps']} steps on {len(self.profiles)} ranks" + (
            f"; no label seen for {', '.join(missing)}" if missing else ""
        )
        return self.profiles
