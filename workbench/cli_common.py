"""What the `workbench` subcommands share: --set overrides, the run arguments, progress, the run summary."""

from __future__ import annotations

import argparse
import sys


def _parse_value(text: str):
    """A --set value read as YAML, numbers as people write them (1e-3 is a float)."""
    import yaml

    from workbench.config import ConfigError
    from workbench.config_io import load_yaml

    try:
        return load_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(f"--set value {text!r} is not valid YAML: {getattr(err, 'problem', None) or err}") from err


def _overrides(args: argparse.Namespace) -> dict:
    from workbench.config import ConfigError

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


def _add_common(p: argparse.ArgumentParser) -> None:
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


def _wants_bar(args: argparse.Namespace) -> bool:
    """Whether rank 0 draws a progress bar: asked for, or by default when stdout is a terminal (not CI or a pipe)."""
    mode = getattr(args, "progress", "auto")
    return mode == "bar" or (mode == "auto" and sys.stdout.isatty())


def _progress_callbacks(bar: bool) -> list:
    from workbench.train.progress_bar import ProgressBar

    return [ProgressBar()] if bar else []


def _print_summary(run_path: str) -> None:
    """The run's summary (workbench.runs.run_summary) on stdout; a run directory that cannot be read says so."""
    from workbench.runs.run_summary import summary_lines

    try:
        lines = summary_lines(run_path)
    except (OSError, ValueError) as err:
        lines = [f"run directory {run_path}: cannot read its summary ({err})"]
    print("\n".join(lines), flush=True)
