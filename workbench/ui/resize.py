"""Fit plotly figures to the notebook's width.

A plotly FigureWidget measures its container once, when it is drawn. The Studio draws its figures
inside tabs that are hidden at the time (0 px wide: plotly falls back to 700 px), so a figure kept
that width: wider than a narrow notebook, narrower than a wide one. `FigureFit` is a tiny
invisible anywidget (plotly's FigureWidget already needs anywidget) that watches the width of the
box it sits in and sets every registered figure's width from it, whenever that width changes.
"""

from __future__ import annotations

from typing import Any

import anywidget
import traitlets

_ESM = """
export default {
  render({ model, el }) {
    el.style.display = "none";
    const box = el.parentElement;
    if (!box || typeof ResizeObserver !== "function") return;
    let last = 0;
    const report = () => {
      const width = Math.floor(box.getBoundingClientRect().width);
      if (width >= 200 && Math.abs(width - last) >= 8) {  // hidden (0 px) or jitter: keep the last width
        last = width;
        model.set("width", width);
        model.save_changes();
      }
    };
    const observer = new ResizeObserver(() => requestAnimationFrame(report));
    observer.observe(box);
    requestAnimationFrame(report);
    return () => observer.disconnect();
  }
};
"""


class FigureFit(anywidget.AnyWidget):
    """Put it in a box: `fit(figure, margin_px)` keeps the figure `margin_px` narrower than that box."""

    _esm = _ESM
    width = traitlets.Int(0).tag(sync=True)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._figures: list[tuple[Any, int]] = []
        self.observe(lambda _: self._apply(), "width")

    def fit(self, figure: Any, margin_px: int = 40) -> None:
        """Keep `figure` (a plotly FigureWidget) as wide as the box less `margin_px`."""
        self._figures.append((figure, margin_px))
        self._apply()

    def _apply(self) -> None:
        if self.width <= 0:
            return
        for figure, margin in self._figures:
            figure.layout.width = max(320, self.width - margin)
