"""One self-contained HTML page per launch: loss curves, step times, throughput and memory."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any


def figure(result: dict[str, Any]):
    """A plotly figure of a results dict (plotly must be installed)."""
    from plotly.subplots import make_subplots

    rows = [r for r in result["variants"] if r.get("status") == "ok"]
    fig = make_subplots(
        rows=2,
        cols=2,
        subplot_titles=(
            "loss per step, first round (cross-entropy + aux)",
            "step time per timed step, rounds combined (s)",
            "tokens/s per GPU (median step)",
            "peak memory per rank (GiB)",
        ),
    )
    for r in rows:
        fig.add_scatter(
            x=list(range(len(r["loss"]))),
            y=r["loss"],
            name=r["name"],
            legendgroup=r["name"],
            mode="lines+markers",
            row=1,
            col=1,
        )
        fig.add_scatter(
            x=list(range(len(r["step_time_s"]))),
            y=r["step_time_s"],
            name=r["name"],
            legendgroup=r["name"],
            showlegend=False,
            mode="lines+markers",
            row=1,
            col=2,
        )
    names = [r["name"] for r in rows]
    fig.add_bar(x=names, y=[r["tokens_per_s_per_gpu"] for r in rows], showlegend=False, row=2, col=1)
    fig.add_bar(x=names, y=[r["peak_mem_gib"] for r in rows], showlegend=False, row=2, col=2)
    cfg, dev = result["config"], result["device"]
    fig.update_layout(
        title=f"workbench bench {result['date'][:10]}: {dev['count']} x {dev['name']}, "
        f"{cfg['preset']} L{cfg['layers']}, seq {cfg['seq']}, batch {cfg['batch']}",
        height=800,
    )
    fig.update_xaxes(title_text="step", row=1, col=1)
    fig.update_xaxes(title_text="timed step (round 1, then round 2, ...)", row=1, col=2)
    return fig


def write_html(result: dict[str, Any], path: Path) -> Path | None:
    """Write the page with plotly.js inline (opens offline); None with a note if plotly is absent."""
    try:
        import plotly  # noqa: F401
    except ImportError:
        print(
            f"bench: plotly is not installed, no HTML plot; make it later with "
            f"`workbench bench --html {path.with_suffix('.json')}`",
            file=sys.stderr,
            flush=True,
        )
        return None
    figure(result).write_html(str(path), include_plotlyjs=True, full_html=True)
    return path
