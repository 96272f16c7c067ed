"""Tick spacing for an axis of training steps: whole steps only.

Plotly's automatic ticks put 1.5, 2.5 on a three-step axis (steps are whole numbers), and a fixed
integer format would then print "2" twice; a whole-step spacing of 1, 2 or 5 times a power of ten
gives distinct labels at any length of run.
"""

from __future__ import annotations

import math


def step_dtick(first: int, last: int, target: int = 6) -> int:
    """Steps between ticks over [first, last]: the smallest 1, 2 or 5 x 10^k giving at most `target` ticks."""
    if target < 2:
        raise ValueError(f"target must be at least 2 ticks, got {target}")
    span = max(1, last - first)
    raw = span / (target - 1)
    power = 10 ** max(0, math.floor(math.log10(raw))) if raw >= 1 else 1
    for mult in (1, 2, 5, 10):
        if mult * power >= raw:
            return mult * power
    return 10 * power
