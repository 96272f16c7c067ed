"""`workbench plan CONFIG`: the run's predicted memory per rank, step time and tokens/s per GPU, before anything is
built, and what would make it fit (workbench.plan)."""

from __future__ import annotations

import argparse
import json

from workbench.cli_common import config_overrides
from workbench.config_checks import ConfigError


def plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="RunConfig YAML file")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override any config field by dotted key, e.g. --set train.activation_checkpointing=true (repeatable)",
    )
    p.add_argument("--gpus", type=int, metavar="N", help="ranks (default: the config's mesh.dp, else 1)")
    p.add_argument(
        "--gpu",
        metavar="KIND",
        help="h100, h200, a100 or cpu (default: this machine's GPU; h100 where it has none)",
    )
    p.add_argument(
        "--gpu-memory", type=float, metavar="GIB", help="memory of one rank's device in GiB (default: the GPU kind's)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the text report")


def _planner():
    """workbench.plan and the RunConfig, imported when the subcommand runs: torch and Transformers load with them,
    which `workbench --help` never waits for."""
    import workbench.plan as plan
    from workbench.config import RunConfig

    return plan, RunConfig


def run_plan(args: argparse.Namespace) -> int:
    plan_mod, run_config = _planner()
    if args.gpus is not None and args.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1, got {args.gpus}")
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        raise ConfigError(f"--gpu-memory must be > 0 GiB, got {args.gpu_memory}")
    rc = run_config.from_yaml(args.config)
    overrides = config_overrides(args)
    if overrides:
        rc = rc.with_overrides(overrides)
    gpu = args.gpu
    if gpu is None:
        kind, _, _ = plan_mod.local_gpu()
        gpu = "h100" if kind == "cpu" else None  # None: this machine's GPU, its name and memory
    try:
        plan = plan_mod.plan_run(rc, gpus=args.gpus, gpu=gpu, gpu_memory_gib=args.gpu_memory)
    except ValueError as err:  # an unknown --gpu, a mesh the rank count cannot take
        raise ConfigError(str(err)) from err
    print(json.dumps(plan.to_dict()) if args.json else plan.text(), flush=True)
    return 0
