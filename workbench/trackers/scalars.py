"""A step record (workbench.train.metrics) as the flat name -> number mapping the trackers log."""

from __future__ import annotations

import math
from typing import Any

from workbench.runs.moe_health import HEALTH_KEYS

# Record fields that are not metrics of the step (where it ran, when), or repeat another under a second name.
NOT_LOGGED = ("step", "rank", "time", "peak_mem_gib")


def step_scalars(record: dict[str, Any]) -> dict[str, float]:
    """Every number of `record` (loss, lr, tokens/s, TFLOP/s, memory, eval loss, ...) under its record name, and
    each MoE health list as `<name>/layer_<i>` and `<name>/mean`; the expert load and router bias matrices are
    left to metrics.jsonl (their per-layer summaries are the health lists)."""
    out: dict[str, float] = {}
    for key, value in record.items():
        if key in NOT_LOGGED or isinstance(value, bool):
            continue
        if isinstance(value, (int, float)):
            out[key] = float(value)
        elif key in HEALTH_KEYS and value:  # per-layer lists: one number a layer, and their mean
            for i, v in enumerate(value):
                out[f"{key}/layer_{i:02d}"] = float(v)
            out[f"{key}/mean"] = math.fsum(value) / len(value)
    return out
