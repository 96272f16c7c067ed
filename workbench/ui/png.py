"""A PNG of the live plots: plotly's own export (kaleido) when it works, else matplotlib."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.ui.series import LIVE_PANELS, PER_RANK


def save_live_png(figure: Any, series: dict[str, Any], path: Path) -> Path:
    """Write `figure` to `path`; without a working kaleido, redraw `series` with matplotlib."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        figure.write_image(str(path), width=1400, height=800)
        return path
    except Exception as kaleido_error:  # kaleido absent, or it has no browser to drive
        try:
            _matplotlib_png(series, path)
        except ImportError:
            raise RuntimeError(
                f"cannot write {path}: plotly's export failed ({kaleido_error}) and matplotlib is "
                "not installed; pip install matplotlib (or kaleido with a Chrome)"
            ) from None
        return path


def _matplotlib_png(series: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: no display on a GPU node
    import matplotlib.pyplot as plt

    fig = plt.figure(figsize=(15, 8), constrained_layout=True)
    grid = fig.add_gridspec(2, 3)
    for col, metric in enumerate(PER_RANK):
        ax = fig.add_subplot(grid[0, col])
        for rank, (steps, values) in sorted(series["per_rank"][metric].items()):
            ax.plot(steps, values, marker="o", label=f"rank {rank}")
        ax.set_title(LIVE_PANELS[metric])
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
    ax = fig.add_subplot(grid[1, 0])
    ax.plot(*series["loss"], marker="o", color="#444", label="loss")
    if series.get("eval_loss", ([], []))[0]:
        ax.plot(*series["eval_loss"], marker="s", linestyle="--", color="#d62728", label="eval loss")
        ax.legend(fontsize=8)
    ax.set_title("loss")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("step")
    ax = fig.add_subplot(grid[1, 1:])
    load = series["expert_load"]
    if load["z"]:
        from matplotlib.colors import TwoSlopeNorm

        vmax = max(2.0, max(max(row) for row in load["z"]))
        image = ax.imshow(load["z"], aspect="auto", cmap="RdBu_r", norm=TwoSlopeNorm(1.0, 0.0, vmax))
        ax.set_yticks(range(len(load["z"])), [f"layer {i}" for i in range(len(load["z"]))])
        ax.set_xlabel("expert")
        fig.colorbar(image, ax=ax, label="load / uniform")
        ax.set_title(f"expert load at step {load['step']} (x uniform)")
    else:
        ax.set_title("expert load: no records yet")
    fig.savefig(path, dpi=100)
    plt.close(fig)
