"""A training step's statistics kept on the device and read back later, without a host sync in the step.

`Trainer.train_step` leaves its loss sums, grad norm, token count, non-finite flag, expert load and
router biases on the device, packed into one float64 vector (`StatsLayout`), and queues one
non-blocking copy of it into pinned host memory followed by an event. `Trainer.collect` turns the
steps whose event has completed into records. Times come from `Clock` marks: CUDA events recorded
on the stream (device time, GPU idle time included) or `time.perf_counter` on the CPU, where every
op runs synchronously anyway.

The non-finite guard (`SkipFlag`) is a float32 device scalar, sticky: once a step's global loss,
aux loss or grad norm is non-finite, that step and every later one skips its optimizer update
(the optimizer reads the flag on the device: torch's fused AdamW `found_inf`, TritonAdamW's
`found_inf`), and the first bad step is remembered on the device for the error `collect` raises.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

# Entries of the stats vector before the expert load and the router biases.
SCALARS = ("ce", "aux", "grad_norm", "bad", "skipping", "first_bad", "loss_tokens")


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` (a host tensor) on `device` without a host sync: pinned, then an asynchronous copy."""
    if device.type != "cuda" or t.device == device:
        return t.to(device)
    # A copy from pageable memory is synchronous; a pinned block of the caching host allocator is
    # not reused before the copy that reads it has run.
    return t.pin_memory().to(device, non_blocking=True)


class Clock:
    """Time marks on the device's stream (CUDA events) or on the host (perf_counter elsewhere)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        """A mark now: on CUDA when the stream reaches this point, else the host's time."""
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def done(self, mark: Any) -> bool:
        """Whether the device has passed `mark` (always on the CPU)."""
        return mark.query() if self.cuda else True

    def wait(self, mark: Any) -> None:
        """Block the host until the device has passed `mark`."""
        if self.cuda:
            mark.synchronize()

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two passed marks."""
        return start.elapsed_time(end) / 1e3 if self.cuda else end - start


@dataclass(frozen=True)
class StatsLayout:
    """Where things sit in the stats vector: the SCALARS, the expert load [L, E], the router biases, the router
    entropy [L] (train/router_entropy; 0 layers where the router logits are not recorded)."""

    load_shape: tuple[int, ...] = ()
    bias_sizes: tuple[int, ...] = ()
    entropy_layers: int = 0

    def __post_init__(self) -> None:
        if len(self.load_shape) not in (0, 2):
            raise ValueError(f"load_shape must be () or (layers, experts), got {self.load_shape}")

    def pack(
        self,
        scalars: dict[str, torch.Tensor],
        load: torch.Tensor | None,
        biases: list[torch.Tensor] | None,
        entropy: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One float64 vector on the scalars' device (int64 counts are exact below 2**53)."""
        parts = [torch.stack([scalars[k].reshape(()).to(torch.float64) for k in SCALARS])]
        if load is not None:
            parts.append(load.reshape(-1).to(parts[0].device, torch.float64))
        for b in biases or ():
            parts.append(b.detach().reshape(-1).to(parts[0].device, torch.float64))
        if entropy is not None:
            parts.append(entropy.reshape(-1).to(parts[0].device, torch.float64))
        return torch.cat(parts)

    def unpack(self, values: list[float]) -> dict[str, Any]:
        """The host values of a packed vector: SCALARS by name, "expert_load", "router_bias", "router_entropy" as
        lists (None where the vector has none)."""
        out: dict[str, Any] = dict(zip(SCALARS, values))
        i = len(SCALARS)
        out["expert_load"] = None
        if self.load_shape:
            layers, experts = self.load_shape
            flat = [int(x) for x in values[i : i + layers * experts]]
            out["expert_load"] = [flat[r * experts : (r + 1) * experts] for r in range(layers)]
            i += layers * experts
        out["router_bias"] = None
        if self.bias_sizes:
            out["router_bias"] = []
            for n in self.bias_sizes:
                out["router_bias"].append(values[i : i + n])
                i += n
        out["router_entropy"] = values[i : i + self.entropy_layers] if self.entropy_layers else None
        return out


class SkipFlag:
    """The sticky non-finite flag on the device, and the first step that set it."""

    def __init__(self, device: torch.device) -> None:
        # float32: the type torch's fused AdamW reads `found_inf` as (1.0 = skip the update)
        self.found_inf = torch.zeros((), dtype=torch.float32, device=device)
        self.first_bad = torch.zeros((), dtype=torch.float64, device=device)

    def update(self, step: int, values: list[torch.Tensor]) -> torch.Tensor:
        """Set the flag if any of `values` (global, the same on every rank) is not finite; this step's bad flag."""
        device = self.found_inf.device
        finite = torch.stack([torch.isfinite(v.reshape(()).to(device)) for v in values]).all()
        bad = (~finite).to(torch.float32)
        first = (self.found_inf == 0) & (bad > 0)
        self.first_bad.copy_(torch.where(first, torch.full_like(self.first_bad, step), self.first_bad))
        self.found_inf.copy_(torch.maximum(self.found_inf, bad))
        return bad


@dataclass
class PendingStep:
    """One queued step: host facts known at queue time, device marks, the stats copy and its event."""

    step: int
    host: dict[str, Any]  # lr, tokens, memory, wall time: read on the host without waiting
    start: Any
    next_start: Any = None  # the next step's start mark, once it is queued
    end: Any = None
    layout: StatsLayout = StatsLayout()
    phases: list[tuple[str, Any, Any]] = field(default_factory=list)  # (name, start mark, end mark)
    stats: torch.Tensor | None = None  # the host copy (pinned on CUDA)

    def queue_copy(self, layout: StatsLayout, stats: torch.Tensor, clock: Clock) -> None:
        """Copy the device vector (packed by `layout`) to the host asynchronously; the end mark follows it."""
        self.layout = layout
        if stats.device.type == "cuda":
            host = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            host.copy_(stats, non_blocking=True)
            self.stats = host
        else:
            self.stats = stats
        self.end = clock.mark()  # after the copy on the stream: passed means the copy has landed

    def phase_seconds(self, clock: Clock) -> dict[str, float]:
        """Summed seconds per phase name."""
        out: dict[str, float] = {}
        for name, a, b in self.phases:
            out[name] = out.get(name, 0.0) + clock.seconds(a, b)
        return out


class StepQueue:
    """The queued steps in step order; `ready` hands back those whose stats have landed on the host."""

    def __init__(self, clock: Clock, world: int) -> None:
        self.clock, self.world = clock, world
        self.items: list[PendingStep] = []

    def started(self, mark: Any) -> None:
        """A new step started at `mark`: it ends the previous step's time (start to start: GPU idle time in it)."""
        if self.items and self.items[-1].next_start is None:
            self.items[-1].next_start = mark

    def push(self, pending: PendingStep) -> None:
        """Queue a step whose stats copy is queued."""
        self.items.append(pending)

    def ready(
        self, wait: bool, through: int | None = None
    ) -> tuple[list[tuple[PendingStep, dict[str, Any], float]], tuple | None]:
        """([(step, host values, step seconds)] ready now, (step, values) of the first skipped step or None).

        Without `wait` a step is ready once the next one has started on the device (its time needs that
        start), so records come one step late. A skipped step is reported under more than one rank only
        with `wait` (at the same step on every rank: a rank that saw it early must not leave the others
        waiting in a collective); it and every later step are dropped. `through`: wait only for the
        steps up to that one (later ones are taken if they have finished), so the device keeps the
        newest step queued while the host reads the one before.
        """
        out = []
        while self.items:
            pending = self.items[0]
            last = pending.next_start is None
            mark = pending.end if last else pending.next_start
            waited = wait and (through is None or pending.step <= through)
            if waited:
                self.clock.wait(mark)
            elif last or not self.clock.done(mark):
                break
            values = pending.layout.unpack(pending.stats.tolist())
            if values["skipping"]:
                if not waited and self.world > 1:
                    break
                self.items.clear()
                return out, (pending, values)
            self.items.pop(0)
            out.append((pending, values, self.clock.seconds(pending.start, mark)))
        return out, None
