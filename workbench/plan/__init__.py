"""A run's plan before anything is built: per-rank peak memory by part, step time and tokens/s per GPU, whether it
fits, and the RunConfig changes that would make it fit (`workbench.plan.plan_run`, `workbench plan CONFIG`).

Modules: gpus (datasheet figures per GPU kind, host memory), throughputs (datasheet-derived or calibrated), shape (a
RunConfig resolved for a rank count), memory (the parts of the peak), step_time, options, report (Plan, Option),
run_plan (plan_run), table (the README's plan-vs-measurement table).
"""

from __future__ import annotations

from workbench.plan.gpus import GPUS
from workbench.plan.options import auto_option
from workbench.plan.report import Option, Plan
from workbench.plan.run_plan import local_gpu, plan_run

__all__ = ["GPUS", "Option", "Plan", "auto_option", "local_gpu", "plan_run"]
