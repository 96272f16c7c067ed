"""A run directory as text: the figures of its steps, the summary the `workbench` command prints, sparklines.

Everything is read from the run directory (workbench.runs.run_dir), so `workbench finetune`,
`workbench demo` and `workbench show RUN` print the same summary, for a run of this process or
any earlier one.
"""

from __future__ import annotations

import math
import os
from typing import Any

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


def run_figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Steps, training time, throughput, memory and losses of a run from its step records (every rank's).

    Throughput leaves out the first step when there are others: it includes the warm-up
    (allocation, compilation) and would make a short run look slow.
    """
    records = [r for r in records if isinstance(r.get("step"), int)]
    if not records:
        return {"steps": 0}
    first_rank = min(int(r.get("rank", 0)) for r in records)
    own = sorted((r for r in records if int(r.get("rank", 0)) == first_rank), key=lambda r: r["step"])
    steps = sorted({r["step"] for r in records})
    timed = [r for r in records if r["step"] != steps[0]] if len(steps) > 1 else records

    def mean(key: str, rows: list[dict[str, Any]]) -> float | None:
        values = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        return sum(values) / len(values) if values else None

    seconds = None
    if all(isinstance(r.get("time"), (int, float)) for r in (own[0], own[-1])):
        seconds = own[-1]["time"] - own[0]["time"] + float(own[0].get("step_time_s") or 0.0)
    evals = [r for r in own if isinstance(r.get("eval_loss"), (int, float))]
    peaks = [float(r["mem_peak_gib"]) for r in records if isinstance(r.get("mem_peak_gib"), (int, float))]
    return {
        "steps": len(steps),
        "first_step": steps[0],
        "last_step": steps[-1],
        "seconds": seconds,
        "warmup_left_out": len(steps) > 1,
        "tokens_per_s_per_gpu": mean("tokens_per_s_per_gpu", timed),
        "tflops_per_gpu": mean("tflops_per_gpu", timed),
        "peak_gib": max(peaks) if peaks else None,
        "first_loss": own[0].get("loss"),
        "final_loss": own[-1].get("loss"),
        "eval_loss": evals[-1]["eval_loss"] if evals else None,
        "eval_step": evals[-1]["step"] if evals else None,
    }


def _number(value: Any, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) and math.isfinite(value) else "?"


def summary_lines(path: str | os.PathLike) -> list[str]:
    """What a run did, in a few lines: state, steps and time, tokens/s per GPU, losses, where its files are."""
    from workbench.runs.run_dir import RunDir, summarize_run

    summary = summarize_run(path)
    status = summary.get("status") or {}
    figures = run_figures(RunDir(os.fspath(path)).read_metrics())
    state = summary.get("state", "unknown")
    lines = [f"run {state}: {summary['path']}"]
    world = summary.get("world_size")
    ranks = f"{world} rank{'s' if world != 1 else ''}" if isinstance(world, int) else "? ranks"
    where = ", ".join(x for x in (ranks, mesh_label(summary.get("mesh")), str(summary.get("model") or "")) if x)
    total = status.get("total_steps") or summary.get("total_steps") or "?"
    if figures["steps"]:
        took = f" in {figures['seconds']:.1f} s" if figures["seconds"] is not None else ""
        lines.append(f"  steps         {figures['last_step']}/{total}{took} ({where})")
        warm = (
            (
                f" (mean of steps {figures['first_step'] + 1}-{figures['last_step']}; step {figures['first_step']}, "
                "the warm-up, left out)"
            )
            if figures["warmup_left_out"]
            else ""
        )
        peak = f", peak {figures['peak_gib']:.2f} GiB" if figures["peak_gib"] is not None else ""
        lines.append(
            f"  tokens/s/gpu  {_number(figures['tokens_per_s_per_gpu'], ',.0f')}{warm}; "
            f"TFLOP/s/gpu {_number(figures['tflops_per_gpu'], '.3g')}{peak}"
        )
        lines.append(
            f"  loss          {_number(figures['first_loss'], '.4f')} at step {figures['first_step']}, "
            f"final {_number(figures['final_loss'], '.4f')}"
        )
        if figures["eval_loss"] is not None:
            lines.append(f"  eval loss     {figures['eval_loss']:.4f} at step {figures['eval_step']}")
    else:
        lines.append(f"  steps         none recorded of {total} ({where})")
    if state in ("failed", "died") and status.get("error"):
        lines.append(f"  error         {str(status['error']).strip().splitlines()[-1]}")
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
