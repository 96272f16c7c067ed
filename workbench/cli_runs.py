"""`workbench runs` and `workbench show RUN`: the runs directory as a table, one run's summary and plots."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path

# torch-free: `workbench runs` and `workbench show` start in a fraction of a second
from workbench.runs.run_dir import default_runs_dir
from workbench.runs.run_index import list_runs
from workbench.runs.run_names import run_id_problem
from workbench.runs.run_summary import mesh_label, read_run, summary_lines, terminal_plots
from workbench.ui.png import save_live_png
from workbench.ui.series import live_series


def runs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs_dir", nargs="?", help="runs directory (default: $WORKBENCH_RUNS_DIR or ~/moe-workbench/runs)")


def run_runs(args: argparse.Namespace) -> int:
    runs_dir = args.runs_dir or str(default_runs_dir())
    if not os.path.isdir(os.path.expanduser(runs_dir)):
        print(f"workbench runs: no runs directory at {runs_dir}", file=sys.stderr)
        return 2
    runs = list_runs(runs_dir)
    if not runs:
        print(f"no runs in {runs_dir}")
        return 0
    rows = [("RUN", "NAME", "MODEL", "MESH", "STATE", "STEP", "TOK/S/GPU", "LOSS", "KIND", "NOTE")]
    for r in runs:
        if not r.get("readable"):
            rows.append((r["id"], "", "", "", "unreadable", "", "", "", "", r.get("error", "")))
            continue
        status = r.get("status") or {}
        step = "" if r.get("step") is None else f"{r['step']}/{r.get('total_steps') or '?'}"
        loss = "" if not isinstance(r.get("loss"), (int, float)) else f"{r['loss']:.4f}"
        speed = r.get("tokens_per_s_per_gpu")
        speed = f"{speed:,.0f}" if isinstance(speed, (int, float)) else ""
        error = str(status.get("error") or "").strip() if r["state"] in ("failed", "died") else ""
        notes = [error.splitlines()[-1]] if error else []  # the last line of a traceback says what
        if r.get("progress_from"):
            notes.append(f"step and loss from {r['progress_from']}")
        if r.get("metrics_skipped"):
            notes.append(r["metrics_skipped"]["note"])
        kind = (r.get("kind") or {}).get("label", "")
        rows.append(
            (
                r["id"],
                r.get("name") or "",
                str(r.get("model") or ""),
                mesh_label(r.get("mesh")),
                r["state"],
                step,
                speed,
                loss,
                kind,
                "; ".join(notes),
            )
        )
    if not any(row[-1] for row in rows[1:]):
        rows = [row[:-1] for row in rows]  # no notes: no empty column
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    right = {5, 6, 7}  # numbers
    for row in rows:
        cells = [cell.rjust(w) if i in right else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))]
        print("  ".join([*cells, row[-1]]).rstrip())
    return 0


# -- show ------------------------------------------------------------------------------------


def show_arguments(p: argparse.ArgumentParser) -> None:
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


def run_show(args: argparse.Namespace) -> int:
    path = os.path.expanduser(args.run)
    if not os.path.isdir(path):
        problem = run_id_problem(args.run)
        if problem:  # neither a folder nor a run id: say why, without a lookup of a name no run can have
            print(f"workbench show: not a run directory, and {problem}", file=sys.stderr)
            return 2
        path = os.path.join(os.path.expanduser(args.runs_dir or str(default_runs_dir())), args.run)
    if not os.path.isdir(path):
        print(
            f"workbench show: no run {args.run!r}: neither a directory nor a run id in "
            f"{args.runs_dir or default_runs_dir()} (workbench runs lists them)",
            file=sys.stderr,
        )
        return 2
    try:
        # One read of the metrics file, in chunks: the summary's figures and the plots' thinned records.
        reading = read_run(path)
    except (OSError, ValueError) as err:
        print(f"workbench show: cannot read run {path}: {err}", file=sys.stderr)
        return 2
    lines, records = summary_lines(path, reading), reading.plot_records
    plots = terminal_plots(records)
    print("\n".join([*lines, *(["  per step:"] + plots if plots else [])]), flush=True)
    if args.png:
        return _write_png(records, args.png)
    return 0


def _write_png(records: list, png: str) -> int:
    """The Studio's live plots of `records` as a PNG (workbench.ui.png, drawn with matplotlib)."""
    if importlib.util.find_spec("matplotlib") is None:
        print(
            "workbench show: --png needs matplotlib: pip install matplotlib (or pip install -e '.[lab]')",
            file=sys.stderr,
        )
        return 2
    # No plotly figure: the matplotlib drawing of the same series (what a headless node can draw)
    path = save_live_png(None, live_series(records), Path(png).expanduser())
    print(f"  plots         {path}", flush=True)
    return 0
