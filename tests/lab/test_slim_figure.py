"""workbench.ui.slim_figure: which FigureWidget the Studio makes, and what its widget state holds."""

from __future__ import annotations

import pytest

go = pytest.importorskip("plotly.graph_objects")
from workbench.ui.slim_figure import SCRIPT_ENV, SlimFigureWidget, figure_widget, loader_esm  # noqa: E402


def _figure():
    return go.Figure(go.Scatter(x=[1, 2, 3], y=[3, 1, 2], name="loss"))


def test_server_choice_holds_the_loader_not_plotlys_script(monkeypatch):
    monkeypatch.setenv(SCRIPT_ENV, "server")
    slim = figure_widget(_figure())
    monkeypatch.setenv(SCRIPT_ENV, "embed")
    stock = figure_widget(_figure())
    assert isinstance(slim, SlimFigureWidget) and not isinstance(stock, SlimFigureWidget)
    # What a saved notebook holds per figure: the synced state (get_state is what nbclient and the lab save).
    assert slim.get_state()["_esm"] == loader_esm() and len(loader_esm()) < 2000
    assert len(stock.get_state()["_esm"]) > 10**6
    assert [(t["x"], t["y"]) for t in slim.get_state()["_widget_data"]] == [([1, 2, 3], [3, 1, 2])]


def test_auto_uses_the_loader_where_the_lab_extension_is_installed(monkeypatch):
    pytest.importorskip("moe_workbench_lab")
    monkeypatch.delenv(SCRIPT_ENV, raising=False)
    assert isinstance(figure_widget(_figure()), SlimFigureWidget)


def test_a_bad_choice_names_the_variable(monkeypatch):
    monkeypatch.setenv(SCRIPT_ENV, "cdn")
    with pytest.raises(ValueError, match=rf"\${SCRIPT_ENV} must be one of \['auto', 'server', 'embed'\], got 'cdn'"):
        figure_widget(_figure())
