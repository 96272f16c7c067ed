"""Plotly FigureWidgets whose widget state holds a 1 KB loader instead of plotly's 5 MB script.

plotly's FigureWidget is an anywidget: its `_esm` trait is the whole widget bundle (~5 MB), and a
notebook saved with widget state (nbclient / nbconvert --execute always; JupyterLab when "Save
Jupyter widget state in notebooks" is on) holds one copy per figure: the quickstart saved 15.6 MB.
`SlimFigureWidget`'s `_esm` is a loader that imports the same bundle from the lab's server extension
(moe_workbench_lab serves it at <base_url>moe-workbench/plotly/<version>/widgetbundle.js), so the
saved state holds the loader only. `figure_widget` picks it where that extension is installed.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import plotly
import plotly.graph_objects as go

# The route moe_workbench_lab.handlers serves plotly's bundle at, under the server's base URL.
BUNDLE_ROUTE = "moe-workbench/plotly/{version}/widgetbundle.js"
# "auto": the loader where moe_workbench_lab is installed, else plotly's own; "server" / "embed" force one.
SCRIPT_ENV = "WORKBENCH_PLOTLY_SCRIPT"
SCRIPT_CHOICES = ("auto", "server", "embed")

# The page's base URL comes from JupyterLab's page config; the version makes the URL change (and the
# browser's cached copy expire) with plotly, and the server refuses a bundle of another version.
_LOADER = """\
const config = JSON.parse(document.getElementById("jupyter-config-data")?.textContent || "{}");
const base = (config.baseUrl || "/").replace(/\\/?$/, "/");
const url = new URL(base + "%(route)s", document.baseURI).href;
let bundle;
try {
  bundle = await import(url);
} catch (err) {
  throw new Error(`plotly's widget script did not load from ${url} (the moe_workbench_lab server `
    + `extension serves it; without it set %(env)s=embed before making the figures): ${err}`);
}
export default bundle.default;
"""


def loader_esm(version: str = plotly.__version__) -> str:
    """The `_esm` of a SlimFigureWidget: imports plotly `version`'s bundle from the server."""
    return _LOADER % {"route": BUNDLE_ROUTE.format(version=version), "env": SCRIPT_ENV}


class SlimFigureWidget(go.FigureWidget):
    """A plotly FigureWidget whose saved widget state holds the loader, not plotly's bundle."""

    _esm = loader_esm()


def script_choice() -> str:
    """$WORKBENCH_PLOTLY_SCRIPT (default "auto"); a clear error for another value."""
    choice = os.environ.get(SCRIPT_ENV, "auto").strip().lower() or "auto"
    if choice not in SCRIPT_CHOICES:
        raise ValueError(f"${SCRIPT_ENV} must be one of {list(SCRIPT_CHOICES)}, got {choice!r}")
    return choice


def figure_widget(figure: Any = None) -> go.FigureWidget:
    """A FigureWidget of `figure`: slim where the lab's server extension can serve plotly's script."""
    choice = script_choice()
    if choice == "auto":
        choice = "server" if importlib.util.find_spec("moe_workbench_lab") is not None else "embed"
    return SlimFigureWidget(figure) if choice == "server" else go.FigureWidget(figure)
