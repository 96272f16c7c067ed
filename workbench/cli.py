"""The `workbench` command: `workbench finetune CONFIG.yaml`, `workbench demo`, `workbench runs`, `workbench show RUN`.

Subcommands live in a small registry (`SUBCOMMANDS`): each is a name, a help line, a function
adding its arguments and a function running it; add one by adding an entry.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

# Nothing heavy at module level: `workbench --help` and `workbench runs` must not wait seconds for
# torch and Transformers. Each subcommand imports what it needs when it runs (or, for `bench`,
# when its own arguments are added).


@dataclass(frozen=True)
class Subcommand:
    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


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


# -- finetune --------------------------------------------------------------------------------


def _finetune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="RunConfig YAML file")
    _add_common(p)
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


def _torchrun_argv(args: argparse.Namespace) -> list[str]:
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
    return argv


def _run_finetune(args: argparse.Namespace) -> int:
    from workbench.backends import BackendError
    from workbench.config import ConfigError, RunConfig
    from workbench.parallel import dist_utils as du
    from workbench.parallel.launch import report_config_error, run_in_launched_group
    from workbench.train.model_setup import resolve_mesh

    # Everything that can be checked from the config, the model's config.json and the launcher's
    # WORLD_SIZE is checked here, before the process group: under torchrun a mistake is then one
    # line from one rank instead of a traceback per rank.
    launch = args.nproc_per_node is not None and "WORLD_SIZE" not in os.environ
    if launch and args.nproc_per_node < 1:
        print(f"workbench finetune: --nproc-per-node must be >= 1, got {args.nproc_per_node}", file=sys.stderr)
        return 2
    world = args.nproc_per_node if launch else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        rc = RunConfig.from_yaml(args.config)
        overrides = _overrides(args)
        if overrides:
            rc = rc.with_overrides(overrides)
        hf_config = rc.model.hf_config()
        rc.data.check_fits(hf_config)
        mesh = resolve_mesh(rc.mesh, world, hf_config)
        rc.train.accumulation_steps(mesh.dp if mesh is not None else world)
    except (ConfigError, ValueError, TypeError) as err:
        report_config_error("finetune", err)
        return 2
    if launch:
        sys.stdout.flush()
        os.execv(sys.executable, _torchrun_argv(args))  # replaces this process: torchrun's exit code is ours

    def run() -> None:
        from workbench.train import finetune

        rank0 = du.rank() == 0
        result = finetune(rc, callbacks=_progress_callbacks(rank0 and _wants_bar(args)))
        if rank0:
            _print_summary(result["run_dir"])

    return run_in_launched_group(run, "finetune", config_errors=(ConfigError, BackendError))


# -- demo ------------------------------------------------------------------------------------


def _demo_args(p: argparse.ArgumentParser) -> None:
    _add_common(p)
    p.add_argument(
        "--ranks", type=int, default=None, help="processes to run (default: all local GPUs, else 2 CPU ranks over gloo)"
    )


def _demo_rank(payload: dict) -> None:
    """What each spawned demo rank runs: {"config": RunConfig dict, "bar": rank 0 draws a progress bar}."""
    from workbench.config import RunConfig
    from workbench.parallel import dist_utils as du
    from workbench.train import finetune

    finetune(RunConfig.from_dict(payload["config"]), callbacks=_progress_callbacks(payload["bar"] and du.rank() == 0))


def _run_demo(args: argparse.Namespace) -> int:
    import torch

    from workbench.config import RunConfig
    from workbench.runs.run_dir import default_runs_dir, new_run_id

    world = args.ranks or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if world < 1:
        print("workbench demo: --ranks must be >= 1", file=sys.stderr)
        return 2
    rc = RunConfig.demo()
    rc = rc.with_overrides({**_overrides(args), "run_id": args.run_id or new_run_id()})
    runs_dir = rc.output_dir or str(default_runs_dir())
    where = "GPU" if torch.cuda.is_available() else "CPU (gloo)"
    print(
        f"workbench demo: tiny Qwen3-MoE, {rc.train.steps} steps on {world} {where} rank(s); "
        f"run directory {os.path.join(runs_dir, rc.run_id)}",
        flush=True,
    )
    from workbench.parallel.launch import spawn

    run_path = os.path.join(runs_dir, rc.run_id)
    if spawn(
        "workbench.cli:_demo_rank",
        {"config": rc.to_dict(), "bar": _wants_bar(args)},
        world,
        "demo",
        on_failure=lambda exits: _record_rank_failure(run_path, exits),
    ):
        return 1
    _print_summary(run_path)
    return 0


def _record_rank_failure(run_path: str, exits: list) -> None:
    """The launcher saw ranks fail: make status.json say which and how (a killed rank 0 cannot)."""
    from workbench.runs.run_dir import RunDir

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


# -- runs ------------------------------------------------------------------------------------


def _runs_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs_dir", nargs="?", help="runs directory (default: $WORKBENCH_RUNS_DIR or ~/moe-workbench/runs)")


def _run_runs(args: argparse.Namespace) -> int:
    from workbench.runs.run_dir import default_runs_dir, list_runs
    from workbench.runs.run_summary import mesh_label

    runs_dir = args.runs_dir or str(default_runs_dir())
    if not os.path.isdir(os.path.expanduser(runs_dir)):
        print(f"workbench runs: no runs directory at {runs_dir}", file=sys.stderr)
        return 2
    runs = list_runs(runs_dir)
    if not runs:
        print(f"no runs in {runs_dir}")
        return 0
    rows = [("RUN", "MODEL", "MESH", "STATE", "STEP", "TOK/S/GPU", "LOSS", "DETAIL")]
    for r in runs:
        if not r.get("readable"):
            rows.append((r["id"], "", "", "unreadable", "", "", "", r.get("error", "")))
            continue
        status = r.get("status") or {}
        step = "" if r.get("step") is None else f"{r['step']}/{r.get('total_steps') or '?'}"
        loss = "" if not isinstance(r.get("loss"), (int, float)) else f"{r['loss']:.4f}"
        speed = r.get("tokens_per_s_per_gpu")
        speed = f"{speed:,.0f}" if isinstance(speed, (int, float)) else ""
        error = str(status.get("error") or "").strip() if r["state"] in ("failed", "died") else ""
        detail = error.splitlines()[-1] if error else ""  # the last line of a traceback says what
        rows.append(
            (r["id"], str(r.get("model") or ""), mesh_label(r.get("mesh")), r["state"], step, speed, loss, detail)
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    right = {4, 5, 6}  # numbers
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0


# -- show ------------------------------------------------------------------------------------


def _show_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("run", help="run directory, or a run id in the runs directory")
    p.add_argument(
        "--runs-dir", help="where a run id is looked up (default: $WORKBENCH_RUNS_DIR or ~/moe-workbench/runs)"
    )
    p.add_argument(
        "--png",
        metavar="FILE",
        help="also write the live plots (throughput, TFLOP/s, memory per "
        "rank, loss, expert load) to FILE as a PNG (needs matplotlib)",
    )


def _run_show(args: argparse.Namespace) -> int:
    from workbench.runs.run_dir import RunDir, default_runs_dir
    from workbench.runs.run_summary import summary_lines, terminal_plots

    path = os.path.expanduser(args.run)
    if not os.path.isdir(path):
        path = os.path.join(os.path.expanduser(args.runs_dir or str(default_runs_dir())), args.run)
    if not os.path.isdir(path):
        print(
            f"workbench show: no run {args.run!r}: neither a directory nor a run id in "
            f"{args.runs_dir or default_runs_dir()} (workbench runs lists them)",
            file=sys.stderr,
        )
        return 2
    try:
        lines = summary_lines(path)
        records = RunDir(path).read_metrics()
    except (OSError, ValueError) as err:
        print(f"workbench show: cannot read run {path}: {err}", file=sys.stderr)
        return 2
    plots = terminal_plots(records)
    print("\n".join([*lines, *(["  per step:"] + plots if plots else [])]), flush=True)
    if args.png:
        return _write_png(records, args.png)
    return 0


def _write_png(records: list, png: str) -> int:
    """The Studio's live plots of `records` as a PNG (workbench.ui.png, drawn with matplotlib)."""
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("matplotlib") is None:
        print(
            "workbench show: --png needs matplotlib: pip install matplotlib (or pip install -e '.[lab]')",
            file=sys.stderr,
        )
        return 2
    from workbench.ui.png import save_live_png
    from workbench.ui.series import live_series

    # No plotly figure: the matplotlib drawing of the same series (what a headless node can draw)
    path = save_live_png(None, live_series(records), Path(png).expanduser())
    print(f"  plots         {path}", flush=True)
    return 0


# -- bench -----------------------------------------------------------------------------------


def _bench_args(p: argparse.ArgumentParser) -> None:
    from workbench.bench import cli as bench_cli  # its choices come from the backends (torch)

    bench_cli.add_arguments(p)


def _run_bench(args: argparse.Namespace) -> int:
    from workbench.bench import cli as bench_cli

    return bench_cli.run(args)


SUBCOMMANDS: tuple[Subcommand, ...] = (
    Subcommand(
        "finetune", "fine-tune from a RunConfig YAML (standalone or under torchrun)", _finetune_args, _run_finetune
    ),
    Subcommand("demo", "fine-tune the embedded tiny MoE on 2 CPU ranks or all local GPUs", _demo_args, _run_demo),
    Subcommand(
        "runs",
        "list the runs in a runs directory: model, mesh, state (running, completed, failed, died), "
        "step, tokens/s per GPU, loss",
        _runs_args,
        _run_runs,
    ),
    Subcommand(
        "show",
        "one run's summary and its figures per step in the terminal (--png FILE: its plots)",
        _show_args,
        _run_show,
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
    args = build_parser(argv=argv).parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
