"""`workbench finetune CONFIG.yaml`: check the config before any rank starts, then run it (or torchrun it)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from workbench.cli_common import (
    RunWatch,
    add_run_arguments,
    config_overrides,
    print_summary,
    refused_before_work,
    run_command,
    wants_bar,
)
from workbench.config_checks import ConfigError
from workbench.parallel.launch import report_config_error, run_in_launched_group


def finetune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="RunConfig YAML file")
    add_run_arguments(p)
    p.add_argument("--resume-from", help="checkpoint or run directory to resume from")
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        help="override any config field by dotted key, e.g. --set data.seq_len=4096 (repeatable)",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        metavar="N",
        help="check the config for N ranks in this process, then run it under torchrun with N ranks "
        "on this machine (a config error is then one line, exit code 2, before any rank starts)",
    )
    p.add_argument(
        "--debug",
        action="store_true",
        help="print the traceback of an error on stderr (without it an error is one line, and the traceback of "
        "a failed run goes to error.log in its run directory)",
    )


def torchrun_argv(args: argparse.Namespace) -> list[str]:
    """This command again, for each rank torchrun starts (without --nproc-per-node)."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.nproc_per_node),
        "-m",
        "workbench.cli",
        "finetune",
        args.config,
    ]
    for item in args.set or []:
        argv += ["--set", item]
    for flag, value in (
        ("--steps", args.steps),
        ("--output-dir", args.output_dir),
        ("--run-id", args.run_id),
        ("--resume-from", args.resume_from),
    ):
        if value is not None:
            argv += [flag, str(value)]
    if getattr(args, "progress", "auto") != "auto":
        argv += ["--progress", args.progress]
    if getattr(args, "debug", False):
        argv.append("--debug")
    return argv


def run_finetune(args: argparse.Namespace) -> int:
    # Everything that can be checked from the config, the model's config.json and the launcher's
    # WORLD_SIZE (or --nproc-per-node) is checked here, before the process group and before torchrun
    # starts a rank: the trainer's own checks of the rank count (workbench.train.world_checks), so a
    # mistake is one line from this process instead of a traceback per rank.
    launch = args.nproc_per_node is not None and "WORLD_SIZE" not in os.environ
    if launch and args.nproc_per_node < 1:
        print(f"workbench finetune: --nproc-per-node must be >= 1, got {args.nproc_per_node}", file=sys.stderr)
        return 2
    world = args.nproc_per_node if launch else int(os.environ.get("WORLD_SIZE", "1"))
    command = run_command()
    try:
        rc = command.checked_config(args.config, config_overrides(args), world)
    except (ConfigError, ValueError, TypeError) as err:
        if args.debug:
            traceback.print_exc()
        report_config_error("finetune", err)
        return 2
    if launch:
        sys.stdout.flush()
        os.execv(sys.executable, torchrun_argv(args))  # replaces this process: torchrun's exit code is ours

    watch = RunWatch()

    def run() -> None:
        result = command.run_rank(rc, wants_bar(args), (watch,))
        if result is not None:  # rank 0
            print_summary(result["run_dir"])

    return run_in_launched_group(
        run,
        "finetune",
        refused=lambda err: refused_before_work(err, watch),
        debug=args.debug,
        traceback_to=watch.log_traceback,
    )
