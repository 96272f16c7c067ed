"""Studio: the panels composed into one app-like widget for a cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import ipywidgets as W

from workbench.runs.run_dir import default_runs_dir
from workbench.ui.logic import device_of
from workbench.ui.panels import BackendPanel, MeshPanel, ModelPanel
from workbench.ui.plots import CompareRuns, LivePlots
from workbench.ui.profile import ProfilePanel
from workbench.ui.resize import FigureFit
from workbench.ui.run_panel import RunPanel
from workbench.ui.summary import SummaryStrip
from workbench.ui.try_tab import TryTab


def _column(children: list, basis: str) -> W.VBox:
    """A column that takes its share of the notebook's width and goes under its neighbour when narrow."""
    return W.VBox(children, layout=W.Layout(flex=f"1 1 {basis}", min_width="0", margin="0 12px 0 0"))


class Studio:
    """Setup (model, mesh, backends, run), Live plots, Compare runs, Profile and Try (ask a run's model) tabs for
    `cluster`.

    Display it with `display(studio)` or as the last expression of a cell. `studio.run_config()`
    is the RunConfig the widgets describe; `studio.start(config=None)` starts a run and follows it.
    """

    def __init__(
        self,
        cluster: Any,
        runs_dir: str | Path | None = None,
        preset: str = "tiny",
        layers: int | None = None,
        steps: int = 20,
    ) -> None:
        self.cluster = cluster
        self.rank_infos = cluster.info() if cluster is not None and not cluster.busy else None
        world = cluster.world_size if cluster is not None else 1
        device = device_of(self.rank_infos, getattr(cluster, "device_type", "cpu"))
        memory = (
            min((i.get("device_memory_gib") or 0 for i in self.rank_infos), default=None)
            if self.rank_infos and device == "cuda"
            else None
        )
        self.runs_dir = Path(runs_dir).expanduser() if runs_dir else default_runs_dir()
        self.model = ModelPanel(preset=preset, layers=layers)
        name = (self.rank_infos or [{}])[0].get("device_name") if device == "cuda" else None
        self.mesh = MeshPanel(world, device, memory, name)  # each mesh's plan on this GPU
        self.backend = BackendPanel(self.rank_infos, device, world)
        self.run_panel = RunPanel(
            cluster, self.model, self.mesh, self.backend, runs_dir=str(self.runs_dir), steps=steps
        )
        self.live = LivePlots()
        self.strip = SummaryStrip(self.rank_infos)
        self.compare = CompareRuns(runs_dir=self.runs_dir)
        self.profiler = ProfilePanel(cluster, self.run_config)
        self.try_tab = TryTab(self.runs_dir)
        self.model.on_change(lambda: self.mesh.set_model(self.model.hf_config()))
        self.model.on_change(lambda: self.backend.set_model(self.model.hf_config()))
        self.mesh.on_change(self._mesh_changed)
        self.run_panel.on_change(self._training_changed)
        self.backend.fused_ce.observe(lambda _: self._training_changed(), "value")
        self.model.dtype.observe(lambda _: self._training_changed(), "value")
        self.run_panel.on_run(self.live.attach)
        self.run_panel.on_run(self.strip.attach)
        self.run_panel.on_run(lambda run: run.on_metrics(lambda _: self._run_done(run)))
        self.run_panel.on_run(self._hold_buttons)
        self.profiler.on_run(self._hold_buttons)
        self.live.smoothing.observe(lambda change: self.strip.set_smoothing(float(change["new"])), "value")
        self.mesh.set_model(self.model.hf_config())
        self.backend.set_model(self.model.hf_config())
        self._training_changed()
        setup = W.HBox(
            [_column([self.model.widget, self.mesh.widget], "420px"), _column([self.backend.widget], "480px")],
            layout=W.Layout(flex_flow="row wrap", width="100%"),
        )
        live = W.VBox(
            [
                self.run_panel.buttons,
                self.run_panel.progress,
                self.run_panel.status,
                self.strip.widget,
                self.live.widget,
            ]
        )
        self.tabs = W.Tab(
            children=[
                W.VBox([setup, self.run_panel.widget]),
                live,
                self.compare.widget,
                self.profiler.widget,
                self.try_tab.widget,
            ],
            layout=W.Layout(width="100%"),
        )
        for i, title in enumerate(("Setup", "Live", "Compare", "Profile", "Try")):
            self.tabs.set_title(i, title)
        header = W.HTML(
            f"<h3 style='margin:4px 0'>MoE Workbench Studio</h3><div style='overflow-wrap:anywhere'>"
            f"{self._cluster_line(device)}</div>"
        )
        # The figures are drawn in hidden tabs: their width follows the Studio's, not plotly's guess.
        self.fit = FigureFit()
        for figure in (self.live.figure, self.live.health.figure, self.compare.figure, self.profiler.figure):
            self.fit.fit(figure, margin_px=48)
        self.widget = W.VBox([header, self.tabs, self.fit])

    def _cluster_line(self, device: str) -> str:
        if self.cluster is None:
            return "no cluster"
        name = (self.rank_infos or [{}])[0].get("device_name", device)
        return f"{self.cluster.world_size} ranks on {name} ({self.cluster.backend}) &middot; runs in {self.runs_dir}"

    def _mesh_changed(self) -> None:
        mesh = self.mesh.mesh_config()
        if mesh is not None:
            self.backend.set_ep(mesh.ep)

    def _training_changed(self) -> None:
        self.mesh.set_training(
            **self.run_panel.training(), dtype=self.model.dtype.value, fused_ce=self.backend.fused_ce.value
        )

    def _hold_buttons(self, run: Any) -> None:
        """While `run` (trained or profiled) goes, neither Start nor Profile can start another."""
        start, profile = self.run_panel.start_button, self.profiler.button
        start.disabled = profile.disabled = True

        def release(_: Any) -> None:
            if run.done:
                start.disabled = profile.disabled = False

        run.on_metrics(release)

    def _run_done(self, run: Any) -> None:
        if run.done:
            self.compare.refresh()
            self.try_tab.refresh()  # its weights can answer now

    def run_config(self):
        """The RunConfig the Setup tab describes."""
        return self.run_panel.run_config()

    def start(self, config: Any = None):
        """Start `config` (default: the Setup tab's) and show it in the Live tab; returns the Run."""
        run = self.run_panel.start(config)
        if run is None:
            raise RuntimeError(f"run did not start: {self.run_panel.status.value}")
        self.tabs.selected_index = 1
        return run

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
