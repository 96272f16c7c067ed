"""MoE health per layer from the expert load: dead experts, the most and least loaded expert's share, load CV.

Pure Python on a step's `[layers][experts]` token counts, so the trainer's records (train/loop_records), the
Studio's plots and the run readers share one definition without importing torch. The router entropy beside
these in a record comes from the trainer (train/router_entropy).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

# The per-layer lists ([layers] each) a step record carries: from the expert load, then the router's entropy.
LOAD_HEALTH_KEYS = ("moe_dead_share", "moe_max_share", "moe_min_share", "moe_load_cv")
HEALTH_KEYS = (*LOAD_HEALTH_KEYS, "router_entropy")


def load_health(load: Sequence[Sequence[int | float]]) -> dict[str, list[float]]:
    """Per layer of `load` (token counts [layers][experts]): the share of experts with no tokens, the largest and
    smallest expert's share of the layer's tokens, std/mean of the counts (0 = balanced). A layer with no tokens
    at all counts every expert dead and has shares and CV 0."""
    out: dict[str, list[float]] = {k: [] for k in LOAD_HEALTH_KEYS}
    for row in load:
        experts, total = len(row), sum(row)
        if experts == 0:
            continue
        mean = total / experts
        std = math.sqrt(sum((c - mean) ** 2 for c in row) / experts)
        out["moe_dead_share"].append(sum(1 for c in row if c == 0) / experts)
        out["moe_max_share"].append(max(row) / total if total else 0.0)
        out["moe_min_share"].append(min(row) / total if total else 0.0)
        out["moe_load_cv"].append(std / mean if mean > 0 else 0.0)
    return out


def health_over_steps(records: Iterable[dict[str, Any]]) -> dict[str, list[tuple[int, list[float]]]]:
    """The run's MoE health per step over all its ranks: for each of HEALTH_KEYS the records have, [(step,
    [per layer])] in step order. The load figures come from the load summed over the step's ranks (an expert
    dead on one rank may have tokens on another); the router entropy is the mean of the ranks' values."""
    by_step: dict[int, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("expert_load"):
            by_step.setdefault(int(r["step"]), []).append(r)
    out: dict[str, list[tuple[int, list[float]]]] = {}
    for step in sorted(by_step):
        ranks = by_step[step]
        loads = [r["expert_load"] for r in ranks]
        if any(len(load) != len(loads[0]) or len(load[0]) != len(loads[0][0]) for load in loads):
            continue  # a damaged record: its shape is not the run's
        summed = [[sum(load[i][e] for load in loads) for e in range(len(loads[0][i]))] for i in range(len(loads[0]))]
        for key, values in load_health(summed).items():
            out.setdefault(key, []).append((step, values))
        entropies = [r["router_entropy"] for r in ranks if r.get("router_entropy")]
        if entropies:
            out.setdefault("router_entropy", []).append(
                (step, [math.fsum(v) / len(entropies) for v in zip(*entropies)])
            )
    return out
