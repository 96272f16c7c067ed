"""The memory estimate the Studio and the notebooks import from the UI: its formulas live with the run plan
(workbench/plan/estimate.py), below the trainer that plans every run before building it."""

from __future__ import annotations

from workbench.plan.estimate import GIB, MemoryEstimate, estimate_memory, param_counts, resolve_dtype

__all__ = ["GIB", "MemoryEstimate", "estimate_memory", "param_counts", "resolve_dtype"]
