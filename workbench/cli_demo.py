"""`workbench demo`: the embedded tiny MoE fine-tuned on spawned ranks, a failed rank recorded in its run."""

from __future__ import annotations

import argparse
import os
import sys

from workbench.cli_common import add_run_arguments, config_overrides, print_summary, run_command, wants_bar
from workbench.parallel.launch import spawn
from workbench.runs.run_dir import RunDir, default_runs_dir, new_run_id


def demo_arguments(p: argparse.ArgumentParser) -> None:
    add_run_arguments(p)
    p.add_argument(
        "--ranks", type=int, default=None, help="processes to run (default: all local GPUs, else 2 CPU ranks over gloo)"
    )


def run_demo(args: argparse.Namespace) -> int:
    command = run_command()
    world, where = command.demo_world(args.ranks)
    if world < 1:
        print("workbench demo: --ranks must be >= 1", file=sys.stderr)
        return 2
    rc = command.demo_config({**config_overrides(args), "run_id": args.run_id or new_run_id()})
    runs_dir = rc.output_dir or str(default_runs_dir())
    print(
        f"workbench demo: tiny Qwen3-MoE, {rc.train.steps} steps on {world} {where} rank(s); "
        f"run directory {os.path.join(runs_dir, rc.run_id)}",
        flush=True,
    )
    run_path = os.path.join(runs_dir, rc.run_id)
    if spawn(
        "workbench.train.command:demo_rank",
        {"config": rc.to_dict(), "bar": wants_bar(args)},
        world,
        "demo",
        on_failure=lambda exits: _record_rank_failure(run_path, exits),
    ):
        return 1
    print_summary(run_path)
    return 0


def _record_rank_failure(run_path: str, exits: list) -> None:
    """The launcher saw ranks fail: make status.json say which and how (a killed rank 0 cannot)."""
    if not os.path.isfile(os.path.join(run_path, "status.json")):
        return  # the run never got a directory; the ranks' errors are on stderr
    cause = exits[0]
    error = "; ".join(e.describe() for e in exits)
    try:
        # A rank killed by a signal explains what its peers recorded (a broken collective).
        RunDir(run_path).mark_failed(
            error,
            replace_failed=cause.signal_name is not None,
            rank=cause.rank,
            signal=cause.signal_name,
            detected_by="workbench demo",
        )
    except OSError as err:
        print(f"workbench demo: could not record the failure in {run_path}: {err}", file=sys.stderr)
        return
    print(f"workbench demo: run {run_path} failed: {error}", file=sys.stderr, flush=True)
