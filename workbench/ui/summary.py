"""The Live tab's summary strip and progress line: the run's figures at a glance, from its step records.

`summarize_live` is a pure function of the records (tests check it against metrics.jsonl); the
widgets only format what it returns.
"""

from __future__ import annotations

import html
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ipywidgets as W

from workbench.runs.throughput import THROUGHPUT_RULE, THROUGHPUT_WINDOW, StepThroughput
from workbench.ui.progress import format_eta
from workbench.ui.run_title import run_config_of, run_title_text
from workbench.ui.series import ema, warmup_step

# Dense bf16 tensor-core peaks from the vendors' datasheets (TFLOP/s, no sparsity): the MFU denominator.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "B200": 2250.0,
    "L40S": 362.0,
}
# Steps the live figures take their median over (the latest ones, warm-up step left out): the run's
# tokens/s definition's (workbench.runs.throughput), so the strip shows what `workbench runs` shows.
WINDOW = THROUGHPUT_WINDOW


def peak_tflops(device_name: str | None) -> float | None:
    """The datasheet bf16 peak of a GPU by its name ("NVIDIA H200" -> 989), None when not known (CPUs)."""
    name = (device_name or "").upper()
    return next((peak for key, peak in PEAK_BF16_TFLOPS.items() if key in name), None)


@dataclass(frozen=True)
class RankMemory:
    """One rank's latest peak memory against its device's capacity (GiB; capacity None if unknown)."""

    rank: int
    used_gib: float
    capacity_gib: float | None
    kind: str  # the record's mem_kind: "cuda_allocated" or "cpu_rss"


@dataclass(frozen=True)
class LiveSummary:
    """The summary strip's figures (None where the records cannot say yet).

    tokens/s and TFLOP/s: the run's definition (workbench.runs.throughput); step time: per step the
    max over ranks, then the median over the same steps.
    """

    step: int
    total_steps: int | None
    eta_s: float | None
    tokens_per_s_per_gpu: float | None
    tflops_per_gpu: float | None
    mfu_pct: float | None
    step_time_s: float | None
    memory: tuple[RankMemory, ...]
    loss: float | None
    loss_smoothed: float | None
    window: tuple[int, ...]  # the steps the medians are over

    def __post_init__(self) -> None:
        if self.step < 0:
            raise ValueError(f"step must be >= 0, got {self.step}")


def summarize_live(
    records: Sequence[dict],
    total_steps: int | None,
    capacities_gib: dict[int, float] | None = None,
    peak: float | None = None,
    smoothing: float = 0.0,
) -> LiveSummary:
    """The strip's figures from step records (every rank's), the run's total steps, each rank's capacity."""
    by_step: dict[int, dict[int, dict]] = {}
    for r in records:
        if "step" in r and "rank" in r:
            by_step.setdefault(int(r["step"]), {})[int(r["rank"])] = r
    ranks = {rank for rows in by_step.values() for rank in rows}
    complete = sorted(s for s, rows in by_step.items() if set(rows) == ranks)
    warm = warmup_step(list(records))
    steady = [s for s in complete if s != warm] or complete
    window = tuple(steady[-WINDOW:])

    def median_of(metric: str, over_ranks=statistics.fmean) -> float | None:
        values = [
            over_ranks([float(by_step[s][r][metric]) for r in by_step[s]])
            for s in window
            if all(by_step[s][r].get(metric) is not None for r in by_step[s])
        ]
        return statistics.median(values) if values else None

    step = max(by_step, default=0)
    throughput = {key: StepThroughput(key) for key in ("tokens_per_s_per_gpu", "tflops_per_gpu")}
    for r in records:
        for figure in throughput.values():
            figure.add(r)
    tokens, tflops = throughput["tokens_per_s_per_gpu"].value(), throughput["tflops_per_gpu"].value()
    step_time = median_of("step_time_s", over_ranks=max)
    eta = None
    if total_steps and step_time is not None:
        eta = max(0, total_steps - step) * step_time
    memory = []
    for rank in sorted(ranks):
        latest = by_step[max(s for s in by_step if rank in by_step[s])][rank]
        if latest.get("mem_peak_gib") is not None:
            memory.append(
                RankMemory(
                    rank,
                    float(latest["mem_peak_gib"]),
                    (capacities_gib or {}).get(rank),
                    str(latest.get("mem_kind", "")),
                )
            )
    losses = [
        (s, rows[min(rows)]["loss"]) for s, rows in sorted(by_step.items()) if rows[min(rows)].get("loss") is not None
    ]
    loss = float(losses[-1][1]) if losses else None
    smoothed = ema([float(v) for _, v in losses], smoothing)[-1] if losses and smoothing else None
    mfu = 100.0 * tflops / peak if tflops is not None and peak else None
    return LiveSummary(step, total_steps, eta, tokens, tflops, mfu, step_time, tuple(memory), loss, smoothed, window)


def _figure(key: str, label: str, text: str, value: Any = None, title: str = "") -> str:
    data = f" data-value='{value!r}'" if isinstance(value, (int, float)) else ""
    tip = f" title='{html.escape(title, quote=True)}'" if title else ""
    return (
        f"<div class='mwb-fig' data-key='{key}'{data}{tip} style='padding:2px 14px 2px 0'>"
        f"<div style='color:#666;font-size:11px'>{html.escape(label)}</div>"
        f"<div class='mwb-fig-value' style='font-size:15px;font-weight:600'>{html.escape(text)}</div></div>"
    )


def strip_html(s: LiveSummary, done: bool = False, elapsed_s: float | None = None) -> str:
    """The strip as HTML: one box per figure, wrapping on a narrow notebook; data-value holds the raw number."""

    def num(v: float | None, fmt: str) -> str:
        return format(v, fmt) if v is not None else "\u2013"

    eta_text = (
        f"done in {format_eta(elapsed_s)}"
        if done and elapsed_s is not None
        else "done"
        if done
        else format_eta(s.eta_s)
    )
    figures = [
        _figure("step", "step", f"{s.step}/{s.total_steps or '?'}", s.step),
        _figure(
            "eta",
            "ETA" if not done else "time",
            eta_text,
            s.eta_s if not done else None,
            "remaining steps x the median step time",
        ),
        _figure(
            "tokens_per_s_per_gpu",
            "tokens/s per GPU",
            num(s.tokens_per_s_per_gpu, ",.0f"),
            s.tokens_per_s_per_gpu,
            f"{THROUGHPUT_RULE}: steps {list(s.window)}",
        ),
        _figure("tflops_per_gpu", "TFLOP/s per GPU", num(s.tflops_per_gpu, ".3g"), s.tflops_per_gpu),
        _figure(
            "mfu_pct",
            "MFU",
            f"{s.mfu_pct:.1f} %" if s.mfu_pct is not None else "n/a",
            s.mfu_pct,
            "TFLOP/s over the GPU's datasheet bf16 peak"
            if s.mfu_pct is not None
            else "no datasheet peak known for this device (CPU or unlisted GPU)",
        ),
    ]
    for m in s.memory:
        cap = f" / {m.capacity_gib:.1f}" if m.capacity_gib else ""
        what = "process RSS" if m.kind == "cpu_rss" else "allocated peak"
        figures.append(
            _figure(
                f"mem_rank{m.rank}",
                f"memory rank {m.rank} (GiB)",
                f"{m.used_gib:.2f}{cap}",
                m.used_gib,
                f"{what} at the latest step against the device's capacity",
            )
        )
    figures.append(_figure("loss", "loss", num(s.loss, ".4f"), s.loss))
    if s.loss_smoothed is not None:
        figures.append(_figure("loss_smoothed", "loss (smoothed)", num(s.loss_smoothed, ".4f"), s.loss_smoothed))
    return (
        "<div class='mwb-strip' style='display:flex;flex-wrap:wrap;align-items:flex-end;"
        "border-bottom:1px solid #ddd;margin:4px 0 6px 0'>" + "".join(figures) + "</div>"
    )


class SummaryStrip:
    """The summary strip of one run at a time; `attach(run)` follows it through `Run.on_metrics`."""

    def __init__(self, rank_infos: Sequence[dict] | None = None) -> None:
        infos = list(rank_infos or [])
        self.capacities = {
            int(i.get("rank", n)): float(i["device_memory_gib"])
            for n, i in enumerate(infos)
            if i.get("device_memory_gib")
        }
        names = {i.get("device_name") for i in infos if str(i.get("device", "")).startswith("cuda")}
        self.peak = peak_tflops(names.pop()) if len(names) == 1 else None
        self.smoothing = 0.0
        self.run = None
        self._unsubscribe = None
        self._started = time.monotonic()
        self.widget = W.HTML("<div class='mwb-strip-empty' style='color:#666'>no run yet: press Start</div>")
        self.summary: LiveSummary | None = None

    def attach(self, run: Any) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
        self.run, self._started = run, time.monotonic()
        self._unsubscribe = run.on_metrics(lambda _: self.refresh())
        self.refresh()

    def set_smoothing(self, weight: float) -> None:
        self.smoothing = weight
        self.refresh()

    def refresh(self) -> None:
        if self.run is None:
            return
        self.summary = summarize_live(
            self.run.records, self.run.total_steps, self.capacities, self.peak, self.smoothing
        )
        done = self.run.done
        self.widget.value = strip_html(self.summary, done, time.monotonic() - self._started if done else None)


class ProgressLine:
    """A progress bar and a wrapping status line for a run (nothing in it is cut off on a narrow notebook)."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self.bar = W.IntProgress(
            value=0, min=0, max=run.total_steps or 1, layout=W.Layout(flex="1 1 200px", min_width="120px")
        )
        self.label = W.HTML(layout=W.Layout(flex="0 1 auto"))
        self.widget = W.HBox(
            [self.bar, self.label], layout=W.Layout(flex_flow="row wrap", align_items="center", width="100%")
        )
        self._started = time.monotonic()
        self.title = run_title_text(run.run_id, run_config_of(run))
        run.on_metrics(lambda _: self._update())
        self._update()

    def _update(self) -> None:
        run, step = self.run, self.run.last_step or 0
        total = run.total_steps
        if total:
            self.bar.max = total
        self.bar.value = min(step, self.bar.max)
        if run.done:
            self.bar.bar_style = {"completed": "success", "stopped": "warning", "failed": "danger"}.get(run.state, "")
            text = f"{run.state} at step {step}/{total or '?'} in {format_eta(time.monotonic() - self._started)}"
        else:
            text = f"{run.state}: step {step}/{total or '?'}"
        text = f"{self.title}: {text}"
        self.label.value = f"<span class='mwb-progress-text'>{html.escape(text)}</span>"
