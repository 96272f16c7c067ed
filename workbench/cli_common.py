"""What the `workbench` subcommands share: --set overrides, the run arguments, progress, the run summary."""

from __future__ import annotations

import argparse
import os
import sys

import yaml

from workbench.config_checks import ConfigError
from workbench.config_io import load_yaml
from workbench.runs.run_dir import RunDir
from workbench.runs.run_summary import summary_lines


def _parse_value(text: str):
    """A --set value read as YAML, numbers as people write them (1e-3 is a float)."""
    try:
        return load_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set value {text!r} is not valid YAML: {getattr(err, 'problem', None) or err}") from err


def config_overrides(args: argparse.Namespace) -> dict:
    out: dict = {}
    for item in getattr(args, "set", None) or []:
        if "=" not in item:
            raise ConfigError(f"--set expects key=value (e.g. train.lr=1e-3), got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = _parse_value(value)
    for flag, key in (
        ("steps", "train.steps"),
        ("output_dir", "output_dir"),
        ("run_id", "run_id"),
        ("resume_from", "train.resume_from"),
    ):
        value = getattr(args, flag, None)
        if value is not None:
            out[key] = value
    return out


PROGRESS = ("auto", "bar", "lines")  # --progress: auto is a bar on a terminal, lines elsewhere


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--steps", type=int, help="optimizer steps (overrides train.steps)")
    p.add_argument("--output-dir", help="runs directory (default: $WORKBENCH_RUNS_DIR or ~/moe-workbench/runs)")
    p.add_argument("--run-id", help="name of the run directory (default: a timestamp)")
    p.add_argument(
        "--progress",
        choices=PROGRESS,
        default="auto",
        help="bar: a progress bar with ETA and the live figures; lines: one line per logging step "
        "(auto, the default: a bar when stdout is a terminal, else lines)",
    )


def wants_bar(args: argparse.Namespace) -> bool:
    """Whether rank 0 draws a progress bar: asked for, or by default when stdout is a terminal (not CI or a pipe)."""
    mode = getattr(args, "progress", "auto")
    return mode == "bar" or (mode == "auto" and sys.stdout.isatty())


def run_command():
    """workbench.train.command, imported when a run starts: it imports torch and the trainer, which `workbench
    --help`, `workbench runs` and `workbench show` never wait for."""
    import workbench.train.command as command

    return command


# What a run refuses before its steps start: a config, data, backend, mesh or checkpoint that cannot run
# (the ValueErrors each names its fix), a run folder that exists or cannot be written. Exit code 2.
REFUSALS: tuple[type[BaseException], ...] = (ValueError, FileExistsError, PermissionError)


class RunWatch:
    """A `finetune` callback that notes whether the run reached its steps and where its run directory is."""

    def __init__(self) -> None:
        self.started = False
        self.run_dir: str | None = None
        self.rank = 0  # this process's rank, as the trainer reports it with the run directory

    def on_start(self, info: dict) -> None:
        self.started = True
        self.run_dir = info.get("run_dir") or self.run_dir
        self.rank = info.get("rank", self.rank)

    def on_end(self, result: dict) -> None:
        self.run_dir = result.get("run_dir") or self.run_dir

    def log_traceback(self, text: str) -> str | None:
        """`text` appended to the run directory's error log under this rank; its path, or None without a run
        directory (the trainer had not started)."""
        if self.run_dir is None:
            return None
        try:
            return str(RunDir(self.run_dir).log_error(self.rank, text))
        except OSError:
            return None  # a full disk or a removed folder: the caller says how to see the traceback instead


def refused_before_work(err: BaseException, watch: RunWatch) -> bool:
    """Whether `err` refused the run before its steps started (exit code 2), rather than failed it (1)."""
    return not watch.started and isinstance(err, REFUSALS)


def print_summary(run_path: str) -> None:
    """The run's summary (workbench.runs.run_summary) on stdout; a run directory that cannot be read says so."""
    try:
        lines = summary_lines(run_path)
    except (OSError, ValueError) as err:
        lines = [f"run directory {run_path}: cannot read its summary ({err})"]
    print("\n".join(lines), flush=True)


def closed_pipe() -> int:
    """The reader of stdout went away (`workbench show RUN | head`): stop quietly, no traceback; exit status 1.

    Python's own advice: point stdout at /dev/null so the flush at exit does not raise again.
    """
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 1
