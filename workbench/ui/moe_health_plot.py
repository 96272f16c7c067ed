"""MoE health per layer over steps, as small multiples beside LivePlots' expert-load heatmap.

One panel per figure of workbench.runs.moe_health (dead experts, the most and least loaded expert's share, load CV,
the router's normalised entropy), one line per MoE layer, coloured from the first layer to the last. Drawn from
the run's records: the load figures from the load summed over each step's ranks, the entropy averaged over them.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as W
import plotly.graph_objects as go
from plotly.colors import sample_colorscale
from plotly.subplots import make_subplots

from workbench.runs.moe_health import HEALTH_KEYS, health_over_steps
from workbench.ui.slim_figure import figure_widget
from workbench.ui.step_ticks import step_dtick

PANEL_TITLES = {
    "moe_dead_share": "dead experts (share)",
    "moe_max_share": "most loaded expert's share",
    "moe_min_share": "least loaded expert's share",
    "moe_load_cv": "load CV (std / mean)",
    "router_entropy": "router entropy (/ ln E)",
}
# Five panels side by side leave each title about a fifth of the figure: on two lines, a size smaller, they
# no longer run into each other.
TITLE_FONT_PX = 12


def two_lines(title: str) -> str:
    """`title` broken at the space nearest its middle (plotly titles do not wrap by themselves)."""
    spaces = [i for i, c in enumerate(title) if c == " "]
    if not spaces:
        return title
    cut = min(spaces, key=lambda i: abs(i - len(title) / 2))
    return f"{title[:cut]}<br>{title[cut + 1 :]}"


EMPTY_TEXT = "MoE health: no expert load recorded yet"


def layer_colors(layers: int) -> list[str]:
    """One colour per layer, from the first (dark) to the last (light)."""
    if layers <= 1:
        return sample_colorscale("Viridis", [0.0])
    return sample_colorscale("Viridis", [i / (layers - 1) for i in range(layers)])


def health_lines(records: list[dict[str, Any]]) -> dict[str, list[tuple[list[int], list[float]]]]:
    """Per health key the records have, one (steps, values) line per layer."""
    out: dict[str, list[tuple[list[int], list[float]]]] = {}
    for key, points in health_over_steps(records).items():
        layers = len(points[0][1])
        out[key] = [
            ([step for step, values in points if layer < len(values)], [v[layer] for _, v in points if layer < len(v)])
            for layer in range(layers)
        ]
    return out


class MoEHealthPlots:
    """The small multiples; `draw(records)` redraws them from a run's step records."""

    def __init__(self, height: int = 260) -> None:
        self.keys = HEALTH_KEYS
        base = make_subplots(
            rows=1,
            cols=len(self.keys),
            subplot_titles=[two_lines(PANEL_TITLES[k]) for k in self.keys],
            horizontal_spacing=0.05,
        )
        self.figure = figure_widget(base)
        self.figure.update_layout(
            height=height, margin=dict(l=40, r=10, t=56, b=30), showlegend=False, template="plotly_white"
        )
        self.figure.update_annotations(font_size=TITLE_FONT_PX)
        self._traces: dict[tuple[str, int], int] = {}
        self.title = W.HTML(f"<b>{EMPTY_TEXT}</b>")
        self.widget = W.VBox([self.title, self.figure])

    def _trace(self, key: str, layer: int, color: str) -> int:
        if (key, layer) not in self._traces:
            self.figure.add_trace(
                go.Scatter(
                    x=[],
                    y=[],
                    mode="lines",
                    name=f"layer {layer}",
                    line=dict(color=color, width=1.5),
                    hovertemplate=f"layer {layer}, step %{{x}}: %{{y:.3f}}<extra></extra>",
                ),
                row=1,
                col=self.keys.index(key) + 1,
            )
            self._traces[(key, layer)] = len(self.figure.data) - 1
        return self._traces[(key, layer)]

    def draw(self, records: list[dict[str, Any]]) -> None:
        lines = health_lines(records)
        if not lines:
            self.title.value = f"<b>{EMPTY_TEXT}</b>"
            return
        layers = max(len(per_layer) for per_layer in lines.values())
        colors = layer_colors(layers)
        self.title.value = (
            f"<b>MoE health per layer</b> ({layers} MoE layers, first dark to last light; all ranks' tokens)"
        )
        # traces are added before the batch: one added inside it is not in figure.data until the batch ends
        drawn = {
            self._trace(key, layer, colors[layer]): line
            for key, per_layer in lines.items()
            for layer, line in enumerate(per_layer)
        }
        steps = [step for per_layer in lines.values() for line in per_layer for step in line[0]]
        with self.figure.batch_update():
            for index, (steps_of_line, values) in drawn.items():
                self.figure.data[index].x, self.figure.data[index].y = steps_of_line, values
            if steps:  # whole steps: plotly's own ticks put 19.5 and 20.5 around a single step
                self.figure.update_xaxes(tick0=0, dtick=step_dtick(min(steps), max(steps)))
