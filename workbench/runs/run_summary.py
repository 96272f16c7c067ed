"""A run directory as text: the figures of its steps, the summary the `workbench` command prints, sparklines.

Everything is read from the run directory (workbench.runs.run_files names its files), so `workbench finetune`,
`workbench demo` and `workbench show RUN` print the same summary, for a run of this process or
any earlier one. The metrics file is read once, in chunks, through the lab's reader
(workbench.runs.run_index): figures are summed as records pass, the plots get a thinned series.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from workbench.runs.run_files import ERROR_LOG, skipped_note
from workbench.runs.run_index import SeriesRecords, one_off_index
from workbench.runs.throughput import StepThroughput

SPARK_CHARS = "▁▂▃▄▅▆▇█"


def mesh_label(mesh: Any) -> str:
    """'dp2 ep2' from a mesh dict (sizes of 1 beyond dp and ep left out), '' when unknown."""
    if not isinstance(mesh, dict):
        return str(mesh) if mesh else ""
    parts = [
        f"{k}{mesh[k]}"
        for k in ("dp", "ep", "cp", "tp", "pp")
        if isinstance(mesh.get(k), int) and (k in ("dp", "ep") or mesh[k] > 1)
    ]
    return " ".join(parts)


class RunFigures:
    """The figures of a run's step records (every rank's), taken one record at a time: exact, and held in a
    few numbers however long the run (`workbench show` of a 1 GB metrics file holds no record list).

    Tokens/s and TFLOP/s per GPU are the run's one definition of them (workbench.runs.throughput):
    the median of the latest steps, the first step (the warm-up) left out.
    """

    def __init__(self) -> None:
        self.records = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.throughput = {key: StepThroughput(key) for key in _THROUGHPUTS}
        self.peak: float | None = None
        # The lowest rank's first and last step records and its last eval (its losses are the run's).
        self.own_rank: int | None = None
        self.own_first: dict | None = None
        self.own_last: dict | None = None
        self.own_eval: dict | None = None

    def add(self, record: dict[str, Any]) -> None:
        step, rank = record.get("step"), record.get("rank", 0)
        if not _is_int(step) or not _is_int(rank):
            return
        self.records += 1
        if self.first_step is None or step < self.first_step:
            self.first_step = step
        self.last_step = step if self.last_step is None else max(self.last_step, step)
        for figure in self.throughput.values():
            figure.add(record)
        if _is_number(record.get("mem_peak_gib")):
            self.peak = max(float(record["mem_peak_gib"]), self.peak if self.peak is not None else -math.inf)
        if self.own_rank is None or rank < self.own_rank:
            self.own_rank, self.own_first, self.own_last, self.own_eval = rank, None, None, None
        if rank != self.own_rank:
            return
        kept = {k: record[k] for k in _OWN_KEYS if k in record}
        if self.own_first is None or step < self.own_first["step"]:
            self.own_first = kept
        if self.own_last is None or step >= self.own_last["step"]:
            self.own_last = kept
        if _is_number(record.get("eval_loss")) and (self.own_eval is None or step >= self.own_eval["step"]):
            self.own_eval = kept

    def result(self) -> dict[str, Any]:
        """{"records": 0} before any step record; else first/last step, seconds, means, peak, losses."""
        if not self.records:
            return {"records": 0}
        first, last = self.own_first or {}, self.own_last or {}
        seconds = None
        if _is_number(first.get("time")) and _is_number(last.get("time")):
            seconds = last["time"] - first["time"] + float(first.get("step_time_s") or 0.0)
        return {
            "records": self.records,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "seconds": seconds,
            "warmup_left_out": self.last_step != self.first_step,
            "throughput_steps": self.throughput["tokens_per_s_per_gpu"].window_steps(),
            "tokens_per_s_per_gpu": self.throughput["tokens_per_s_per_gpu"].value(),
            "tflops_per_gpu": self.throughput["tflops_per_gpu"].value(),
            "peak_gib": self.peak,
            "first_loss": first.get("loss"),
            "final_loss": last.get("loss"),
            "final_loss_step": last.get("step"),
            "eval_loss": self.own_eval["eval_loss"] if self.own_eval else None,
            "eval_step": self.own_eval["step"] if self.own_eval else None,
        }


_THROUGHPUTS = ("tokens_per_s_per_gpu", "tflops_per_gpu")
_OWN_KEYS = ("step", "time", "step_time_s", "loss", "eval_loss")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def run_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, training time, throughput, memory and losses of a run from its step records (see RunFigures)."""
    figures = RunFigures()
    for record in records:
        figures.add(record)
    return figures.result()


def _number(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and math.isfinite(value) else "?"


class _LatestLoads:
    """The expert-load matrices of each rank's last two records that have one (the plots show the latest
    step every rank reported): a few matrices held, not one per step."""

    def __init__(self, max_ranks: int) -> None:
        self.max_ranks = max_ranks
        self.by_rank: dict[int, list[dict]] = {}

    def add(self, record: dict[str, Any]) -> None:
        rank, step = record.get("rank", 0), record.get("step")
        if not (_is_int(rank) and _is_int(step) and 0 <= rank < self.max_ranks and record.get("expert_load")):
            return
        kept = self.by_rank.setdefault(rank, [])
        kept.append({"step": step, "rank": rank, "expert_load": record["expert_load"]})
        del kept[:-2]

    def records(self) -> list[dict]:
        return [r for kept in self.by_rank.values() for r in kept]


@dataclass
class RunReading:
    """One read of a run directory: its summary (RunIndex), the figures of every record, the records its
    plots need (every rank's plotted numbers, thinned evenly over the run) and what the read skipped."""

    summary: dict[str, Any]
    figures: dict[str, Any]
    plot_records: list[dict[str, Any]]
    scan: dict[str, Any]


def read_run(path: str | os.PathLike) -> RunReading:
    """Read run directory `path` once, in chunks: memory bounded by the plots' points, not the run's length."""
    index = one_off_index()
    summary = index.summarize(Path(path).expanduser())
    figures = RunFigures()
    series = SeriesRecords(index.series_fields, index.limits)
    loads = _LatestLoads(index.limits.series_ranks)

    def take(record: dict) -> None:
        figures.add(record)
        series.take(record)
        loads.add(record)

    scan = index.scan_metrics(Path(path), take)
    plot_records = series.records() + loads.records()
    return RunReading(summary, figures.result(), plot_records, scan)


def summary_lines(path: str | os.PathLike, reading: RunReading | None = None) -> list[str]:
    """What a run did, in a few lines: state, steps and time, tokens/s per GPU, losses, where its files are.

    The last step and loss are the metrics file's, unless status.json holds a later step (a crash tore
    the last metrics line, say): then they are status.json's, and the line says so. A metrics line that
    held no record is named in a line of its own.
    """
    reading = reading or read_run(path)
    summary, figures, scan = reading.summary, reading.figures, reading.scan
    status = summary.get("status") or {}
    state = summary.get("state", "unknown")
    lines = [f"run {state}: {summary['path']}"]
    if summary.get("name"):
        lines.append(f"  name          {summary['name']}")
    if summary.get("kind"):
        lines.append(f"  kind          {summary['kind']['label']}")
    world = summary.get("world_size")
    ranks = f"{world} rank{'s' if world != 1 else ''}" if isinstance(world, int) else "? ranks"
    where = ", ".join(x for x in (ranks, mesh_label(summary.get("mesh")), str(summary.get("model") or "")) if x)
    total = status.get("total_steps") or summary.get("total_steps") or "?"
    status_step = status.get("step")
    if figures["records"]:
        last_step, final_loss, source = figures["last_step"], figures["final_loss"], ""
        if _is_int(status_step) and status_step > last_step:
            status_loss = next((status[k] for k in ("final_loss", "loss") if _is_number(status.get(k))), None)
            last_step, final_loss = status_step, status_loss
            source = (
                f"  progress      step {status_step} and its loss from status.json: the last complete record in "
                f"metrics.jsonl is of step {figures['last_step']}"
            )
        took = f" in {figures['seconds']:.1f} s" if figures["seconds"] is not None else ""
        lines.append(f"  steps         {last_step}/{total}{took} ({where})")
        window = figures["throughput_steps"]
        steps = (
            f"median of steps {window[0]}-{window[-1]}" if len(window) > 1 else f"step {window[0]}" if window else ""
        )
        warm = (
            f" ({steps}"
            + (f"; step {figures['first_step']}, the warm-up, left out)" if figures["warmup_left_out"] else ")")
            if window
            else ""
        )
        peak = f", peak {figures['peak_gib']:.2f} GiB" if figures["peak_gib"] is not None else ""
        lines.append(
            f"  tokens/s/gpu  {_number(figures['tokens_per_s_per_gpu'], ',.0f')}{warm}; "
            f"TFLOP/s/gpu {_number(figures['tflops_per_gpu'], '.3g')}{peak}"
        )
        lines.append(
            f"  loss          {_number(figures['first_loss'], '.4f')} at step {figures['first_step']}, "
            f"final {_number(final_loss, '.4f')}" + (f" at step {last_step}" if source else "")
        )
        if source:
            lines.append(source)
        if figures["eval_loss"] is not None:
            lines.append(f"  eval loss     {figures['eval_loss']:.4f} at step {figures['eval_step']}")
    elif _is_int(status_step):
        lines.append(f"  steps         {status_step}/{total} ({where}; from status.json: no complete metrics record)")
    else:
        lines.append(f"  steps         none recorded of {total} ({where})")
    if scan["skipped"]:
        lines.append(f"  warning       {skipped_note(scan['skipped'], scan['skipped_at'])}")
    if state in ("failed", "died") and status.get("error"):
        lines.append(f"  error         {str(status['error']).strip().splitlines()[-1]}")
    error_log = os.path.join(summary["path"], ERROR_LOG)
    if state in ("failed", "died") and os.path.isfile(error_log):
        lines.append(f"  traceback     {error_log}")
    if status.get("checkpoint"):
        lines.append(f"  checkpoint    {status['checkpoint']}")
    export = os.path.join(summary["path"], "hf")
    if os.path.isdir(export):
        lines.append(f"  export        {export} (Transformers save_pretrained)")
    return lines


def sparkline(values: list[float], width: int = 60) -> str:
    """`values` as one line of block characters, at most `width` wide (evenly thinned), low to high."""
    values = [float(v) for v in values if isinstance(v, (int, float)) and math.isfinite(v)]
    if not values:
        return ""
    if len(values) > width:
        values = [values[round(i * (len(values) - 1) / (width - 1))] for i in range(width)]
    low, high = min(values), max(values)
    span = high - low
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round((v - low) / span * top) if span > 0 else top // 2] for v in values)


def terminal_plots(records: list[dict[str, Any]], width: int = 60) -> list[str]:
    """One sparkline per live figure (rank 0's loss; every rank's mean of the others), with its range."""
    by_step: dict[int, dict[str, list[float]]] = {}
    for r in records:
        if isinstance(r.get("step"), int):
            row = by_step.setdefault(r["step"], {})
            for key in ("loss", "eval_loss", "tokens_per_s_per_gpu", "tflops_per_gpu", "mem_peak_gib"):
                if isinstance(r.get(key), (int, float)):
                    row.setdefault(key, []).append(float(r[key]))
    lines = []
    for key, label, fmt in (
        ("loss", "loss", ".4f"),
        ("eval_loss", "eval loss", ".4f"),
        ("tokens_per_s_per_gpu", "tokens/s/gpu", ",.0f"),
        ("tflops_per_gpu", "TFLOP/s/gpu", ".3g"),
        ("mem_peak_gib", "peak GiB", ".2f"),
    ):
        series = [(s, sum(row[key]) / len(row[key])) for s, row in sorted(by_step.items()) if key in row]
        if not series:
            continue
        values = [v for _, v in series]
        lines.append(
            f"  {label:<13} {sparkline(values, width)}  {format(min(values), fmt)} .. "
            f"{format(max(values), fmt)} (steps {series[0][0]}-{series[-1][0]})"
        )
    return lines
