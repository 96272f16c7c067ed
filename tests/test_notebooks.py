"""The notebooks, executed top to bottom through nbclient on 2 CPU ranks with tiny models.

Each notebook ends in a cell that asserts on its own results; a failing assert fails the test with
the cell's traceback.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("ipyparallel")
pytest.importorskip("plotly")

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
NAMES = [
    "01_quickstart",
    "02_mesh_explorer",
    "03_backend_shootout",
    "04_profiling",
    "05_how_routing_works",
    "06_your_data",
    "07_two_families",
]
CELL_TIMEOUT_S = 240


def _execute(name: str, tmp_path: Path, monkeypatch, **env: str):
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs"))
    for key in ("WORKBENCH_PRESET", "WORKBENCH_LAYERS", "WORKBENCH_SEQ", "WORKBENCH_RANKS", "WORKBENCH_GATE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # The kernel is the current interpreter (jupyter_client maps the "python" kernelspec to it), so it
    # imports this checkout's workbench whether or not it is installed.
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(NOTEBOOKS.parent), os.environ.get("PYTHONPATH")]))
    )
    nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    )
    t0 = time.monotonic()
    client.execute()
    return nb, time.monotonic() - t0


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")


def test_notebooks_are_clean():
    """Committed without outputs, each ending in an asserting code cell."""
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / f"{name}.ipynb", as_version=4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert all(not c.outputs for c in code), f"{name} has saved outputs"
        assert "assert " in code[-1].source, f"{name} does not end in an asserting cell"


def _have(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def _assert_saved_small(nb, path: Path) -> None:
    """Saved with its widget state (as nbclient stores it), the notebook stays under 1 MB.

    Each plotly FigureWidget's state once held plotly's whole 5 MB script (15.6 MB for the
    quickstart); workbench.ui.slim_figure's figures hold a loader of ~1 KB instead.
    """
    nbformat.write(nb, path)
    states = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    anywidgets = [m["state"] for m in states.values() if m["model_name"] == "AnyModel"]
    figures = [s for s in anywidgets if "_widget_layout" in s]  # plotly's; the Studio's FigureFit is one too
    assert figures, "the Studio shows its plots as plotly FigureWidgets"
    assert all("moe-workbench/plotly/" in f["_esm"] for f in figures)
    assert all(len(s["_esm"]) < 2000 for s in anywidgets)
    assert path.stat().st_size < 2**20, f"{path.name} saved {path.stat().st_size / 2**20:.1f} MB"


@pytest.mark.slow
# the default preset, and a hybrid (Mamba2 + attention + MoE layers) through the same cells
@pytest.mark.parametrize("preset", ["tiny", "tiny-nemotron-h"])
def test_quickstart_with_env_parameters(preset, tmp_path, monkeypatch):
    png, metrics = tmp_path / "live.png", tmp_path / "metrics.jsonl"
    env = {"WORKBENCH_STEPS": "3", "WORKBENCH_METRICS_OUT": str(metrics), "WORKBENCH_PRESET": preset}
    if _have("matplotlib"):  # the PNG fallback (tests/test_ui.py::test_live_plots_png covers it too)
        env["WORKBENCH_PLOT_PNG"] = str(png)
    nb, seconds = _execute("01_quickstart", tmp_path, monkeypatch, **env)
    assert f"preset={preset} " in _text(next(c for c in nb.cells if c.cell_type == "code"))  # after the title
    assert "ok: 6 (rank, step) records" in _text(nb.cells[-1])
    _assert_saved_small(nb, tmp_path / "01_quickstart.ipynb")
    if "WORKBENCH_PLOT_PNG" in env:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(metrics.read_text().splitlines()) == 6
    assert seconds < 120, f"quickstart took {seconds:.0f} s"


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES[1:])
def test_notebook_runs(name, tmp_path, monkeypatch):
    nb, seconds = _execute(name, tmp_path, monkeypatch)
    assert _text(nb.cells[-1]).startswith("ok"), _text(nb.cells[-1])
    assert seconds < 120, f"{name} took {seconds:.0f} s"
