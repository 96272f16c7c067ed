"""What a plan reports: the predicted peak per rank by part, the step time, whether it fits, and the RunConfig changes
that would make it fit (frozen dataclasses; `to_dict` is `workbench plan --json`'s object)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

GIB = float(1 << 30)


def flag_value(value: Any) -> str:
    """A value as `--set` takes it (YAML: true, null, 8bit)."""
    return json.dumps(value) if not isinstance(value, str) else value


@dataclass(frozen=True)
class Option:
    """One change to a run: its RunConfig dotted fields (and rank count), and the plan of the changed run."""

    change: dict[str, Any]  # RunConfig dotted field -> value
    gpus: int  # ranks the changed run takes (more than the run's own: "more GPUs")
    peak_gib_per_rank: float
    fits: bool
    tokens_per_s_per_gpu: float
    changes_training: bool  # LoRA or a shorter sequence: another run, not the same one in less memory

    def flags(self, gpus_now: int) -> str:
        """The change as command-line flags (`--set k=v ...`, plus `--nproc-per-node N` for more GPUs)."""
        out = [f"--set {k}={flag_value(v)}" for k, v in self.change.items()]
        if self.gpus != gpus_now:
            out.append(f"--nproc-per-node {self.gpus}")
        return " ".join(out)

    def describe(self, gpus_now: int) -> str:
        return (
            f"{self.flags(gpus_now)} ({self.peak_gib_per_rank:.1f} GiB, {self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "change": dict(self.change),
            "gpus": self.gpus,
            "peak_gib_per_rank": round(self.peak_gib_per_rank, 3),
            "fits": self.fits,
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
            "changes_training": self.changes_training,
        }


@dataclass(frozen=True)
class Plan:
    """A run's predicted memory per rank and step time on `gpus` x `gpu`, before anything is built."""

    model: str
    gpu: str  # the kind (workbench.plan.gpus.GPUS)
    gpus: int
    dp: int
    ep: int
    capacity_gib: float  # the memory of one rank's device (host memory available on a CPU)
    usable_gib: float  # what a rank may fill (capacity less workbench.plan.gpus.RESERVE_GIB)
    parts: dict[str, float]  # GiB at the peak, by part; they sum to peak_gib_per_rank
    peak_gib_per_rank: float
    fits: bool
    step_s: float
    tokens_per_s_per_gpu: float
    time_parts: dict[str, float]  # seconds of one step, by part
    throughputs: str  # where the throughputs come from: "datasheet h100" or "calibration <file>"
    options: tuple[Option, ...] = ()  # changes that fit, fastest first (only when the run does not fit)
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "gpu": self.gpu,
            "gpus": self.gpus,
            "dp": self.dp,
            "ep": self.ep,
            "capacity_gib": round(self.capacity_gib, 3),
            "usable_gib": round(self.usable_gib, 3),
            "peak_gib_per_rank": round(self.peak_gib_per_rank, 3),
            "fits": self.fits,
            "step_s": round(self.step_s, 5),
            "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
            "parts": {k: round(v, 4) for k, v in self.parts.items()},
            "time_parts": {k: round(v, 6) for k, v in self.time_parts.items()},
            "throughputs": self.throughputs,
            "options": [o.to_dict() for o in self.options],
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """One line: the peak against the device, the step and the throughput."""
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"{self.model} on {self.gpus} x {self.gpu} (dp {self.dp} x ep {self.ep}): {self.peak_gib_per_rank:.1f} GiB "
            f"per rank of {self.usable_gib:.1f} usable, {verdict}; step {self.step_s * 1e3:,.0f} ms, "
            f"{self.tokens_per_s_per_gpu:,.0f} tokens/s/GPU ({self.throughputs})"
        )

    def refusal(self) -> str:
        """The message of a run refused before it is built: the peak, the largest parts and what would fit (the
        changes on the run's own ranks first)."""
        big = sorted(self.parts.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{k} {v:.1f}" for k, v in big if v > 0)
        fixes = sorted((o for o in self.options if o.fits), key=lambda o: o.gpus != self.gpus)
        if fixes:
            fix = "fits with: " + "; or ".join(o.describe(self.gpus) for o in fixes[:4])
        else:
            fix = "no change found that fits: a larger mesh, LoRA or a shorter data.seq_len"
        where = (
            f"this host has {self.usable_gib:.1f} GiB available per rank"
            if self.gpu == "cpu"
            else f"one {self.gpu.upper()} rank has {self.usable_gib:.1f} GiB usable"
        )
        return (
            f"the run is planned at {self.peak_gib_per_rank:.1f} GiB per rank (largest: {parts} GiB) but {where}; "
            f"{fix} (train.fit: auto applies the fastest that keeps the training; train.fit: off skips this check)"
        )

    def text(self) -> str:
        """Several lines for `workbench plan`: the summary, each part, each option."""
        lines = [self.summary(), "memory per rank at the peak (GiB):"]
        lines += [f"  {k:<18} {v:8.2f}" for k, v in self.parts.items() if v > 0]
        lines.append("step time (ms): " + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in self.time_parts.items() if v > 0))
        if self.options:
            lines.append("options (fastest first):")
            for o in self.options:
                mark = "fits" if o.fits else "does not fit"
                lines.append(
                    f"  {o.flags(self.gpus)}: {o.peak_gib_per_rank:.1f} GiB, {mark}, "
                    f"{o.tokens_per_s_per_gpu:,.0f} tokens/s/GPU"
                )
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)
