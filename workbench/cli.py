"""The `workbench` command: `workbench finetune CONFIG.yaml`, `workbench demo`, `workbench runs`, `workbench show RUN`.

Subcommands live in a small registry (`SUBCOMMANDS`): each is a name, a help line, a function
adding its arguments and a function running it; add one by adding an entry.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

# Nothing heavy at module level, here and in the cli_*.py modules each subcommand lives in:
# `workbench --help` and `workbench runs` must not wait seconds for torch and Transformers. Each
# subcommand imports what it needs when it runs (or, for `bench`, when its own arguments are added).
from workbench.cli_common import closed_pipe
from workbench.cli_demo import demo_arguments, run_demo
from workbench.cli_finetune import finetune_arguments, run_finetune
from workbench.cli_generate import generate_arguments, run_generate
from workbench.cli_plan import plan_arguments, run_plan
from workbench.cli_runs import run_runs, run_show, runs_arguments, show_arguments
from workbench.config_checks import ConfigError

__all__ = ["SUBCOMMANDS", "Subcommand", "build_parser", "main"]


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# -- bench -----------------------------------------------------------------------------------


def _bench_cli():
    """workbench.bench.cli, imported when `bench` is the subcommand: its choices come from the backends (torch)."""
    import workbench.bench.cli as bench_cli

    return bench_cli


def _bench_args(p: argparse.ArgumentParser) -> None:
    _bench_cli().add_arguments(p)


def _run_bench(args: argparse.Namespace) -> int:
    return _bench_cli().run(args)


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "finetune", "fine-tune from a RunConfig YAML (standalone or under torchrun)", finetune_arguments, run_finetune
    ),
    Subcommand("demo", "fine-tune the embedded tiny MoE on 2 CPU ranks or all local GPUs", demo_arguments, run_demo),
    Subcommand(
        "plan",
        "a run's memory per rank, step time and tokens/s per GPU before anything is built, and what would fit",
        plan_arguments,
        run_plan,
    ),
    Subcommand(
        "runs",
        "list the runs in a runs directory: model, mesh, state (running, completed, failed, died), "
        "step, tokens/s per GPU, loss",
        runs_arguments,
        run_runs,
    ),
    Subcommand(
        "show",
        "one run's summary and its figures per step in the terminal (--png FILE: its plots)",
        show_arguments,
        run_show,
    ),
    Subcommand(
        "generate",
        "ask a run's model: its latest weights (export or checkpoint) answer a prompt, streamed token by token",
        generate_arguments,
        run_generate,
    ),
    Subcommand(
        "bench", "Transformers v5 anchor vs the engine, timed in one launch (see benchmarks/)", _bench_args, _run_bench
    ),
)


def _chosen(argv: list[str], subcommands: tuple[Subcommand, ...]) -> str | None:
    """The subcommand `argv` names (the top level takes no option but --help), or None."""
    names = {cmd.name for cmd in subcommands}
    first = next((a for a in argv if not a.startswith("-")), None)
    return first if first in names else None


def build_parser(
    subcommands: tuple[Subcommand, ...] = SUBCOMMANDS, argv: list[str] | None = None
) -> argparse.ArgumentParser:
    """The parser; given `argv`, only the subcommand it names gets its arguments (and their imports)."""
    parser = argparse.ArgumentParser(prog="workbench", description="MoE Workbench: fine-tune MoE LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = None if argv is None else _chosen(argv, subcommands)
    for cmd in subcommands:
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if argv is None or cmd.name == chosen:
            cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `workbench` console script."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv=argv).parse_args(argv)  # --help writes too
        try:
            return int(args._run(args) or 0)
        except ConfigError as err:  # a subcommand's own arguments or config refused before any work
            print(f"workbench {args.command}: {err}", file=sys.stderr, flush=True)
            return 2
    except BrokenPipeError:
        return closed_pipe()


if __name__ == "__main__":
    sys.exit(main())
