"""`workbench demo`: the embedded tiny MoE fine-tuned on spawned ranks, a failed rank recorded in its run."""

from __future__ import annotations

import argparse
import functools
import os
import sys

from workbench.cli_common import (
    RunWatch,
    add_run_arguments,
    config_overrides,
    print_summary,
    refused_before_work,
    run_command,
    wants_bar,
)
from workbench.parallel.launch import report_rank_failure, spawn
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
    try:  # checked for the rank count here, so a mistake is one line from this process, not a traceback per rank
        rc = command.checked_for_world(
            command.demo_config({**config_overrides(args), "run_id": args.run_id or new_run_id()}), world
        )
    except (ValueError, TypeError) as err:  # ConfigError among them
        print(f"workbench demo: {err}", file=sys.stderr)
        return 2
    runs_dir = rc.output_dir or str(default_runs_dir())
    print(
        f"workbench demo: tiny Qwen3-MoE, {rc.train.steps} steps on {world} {where} rank(s); "
        f"run directory {os.path.join(runs_dir, rc.run_id)}",
        flush=True,
    )
    run_path = os.path.join(runs_dir, rc.run_id)
    code = spawn(
        "workbench.cli_demo:demo_rank",
        {"config": rc.to_dict(), "bar": wants_bar(args)},
        world,
        "demo",
        on_failure=lambda exits: _record_rank_failure(run_path, exits),
    )
    if code:
        return code
    print_summary(run_path)
    return 0


def demo_rank(payload: dict) -> None:
    """Each spawned rank's run; a failure is one line as `workbench finetune` says it (the traceback in the run's
    error log), and the rank leaves with its exit code (2: refused before the steps started)."""
    watch = RunWatch()
    try:
        run_command().demo_rank(payload, (watch,))
    except Exception as err:  # noqa: BLE001 - said in one line; the launcher names the exit codes
        refused = functools.partial(refused_before_work, watch=watch)
        code = report_rank_failure(err, "demo", refused, traceback_to=watch.log_traceback, rank=watch.rank)
        raise SystemExit(code) from None


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
