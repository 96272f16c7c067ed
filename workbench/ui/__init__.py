"""Notebook widgets: setup panels, live plots, run comparison, profiling, and the Studio app; the command line's
progress bar (terminal_progress, tqdm only).

The widgets need ipywidgets, plotly and anywidget (the `lab` extra); the engines never do. Names are
imported on first use, so the pure-logic modules (workbench.ui.logic, .memory) import without them:
the GPU image has no ipywidgets, and its tests import the backend resolution from here.
"""

from __future__ import annotations

from typing import Any

_LAZY = {
    "backend_choices": "workbench.ui.logic",
    "mesh_options": "workbench.ui.logic",
    "resolve_auto": "workbench.ui.logic",
    "estimate_memory": "workbench.ui.memory",
    "param_counts": "workbench.ui.memory",
    "BackendPanel": "workbench.ui.panels",
    "MeshPanel": "workbench.ui.panels",
    "ModelPanel": "workbench.ui.panels",
    "CompareRuns": "workbench.ui.plots",
    "LivePlots": "workbench.ui.plots",
    "ProfilePanel": "workbench.ui.profile",
    "load_profile": "workbench.ui.profile",
    "RunPanel": "workbench.ui.run_panel",
    "Studio": "workbench.ui.studio",
    "SummaryStrip": "workbench.ui.summary",
    "summarize_live": "workbench.ui.summary",
}

__all__ = list(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench.ui' has no attribute {name!r}")
