"""Notebook widgets: setup panels, live plots, run comparison, profiling, and the Studio app.

Importing this needs ipywidgets, plotly and anywidget (the `lab` extra); the engines never do.
"""

from workbench.ui.logic import backend_choices, mesh_options, resolve_auto
from workbench.ui.memory import estimate_memory, param_counts
from workbench.ui.panels import BackendPanel, MeshPanel, ModelPanel
from workbench.ui.plots import CompareRuns, LivePlots
from workbench.ui.profile import ProfilePanel, load_profile
from workbench.ui.run_panel import RunPanel
from workbench.ui.studio import Studio
from workbench.ui.summary import SummaryStrip, summarize_live

__all__ = [
    "BackendPanel",
    "CompareRuns",
    "LivePlots",
    "MeshPanel",
    "ModelPanel",
    "ProfilePanel",
    "RunPanel",
    "Studio",
    "SummaryStrip",
    "backend_choices",
    "estimate_memory",
    "load_profile",
    "mesh_options",
    "param_counts",
    "resolve_auto",
    "summarize_live",
]
