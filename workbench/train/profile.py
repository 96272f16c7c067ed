"""Profile training steps on every rank: torch.profiler traces and a per-phase time breakdown.

`profile_finetune(run_config, callbacks)` is `finetune` with a profiler callback: it skips the
first step (warm-up: allocator, autotuning, first all-to-all), records the rest, and writes into
<run_dir>/profile/ per rank: trace_rank{r}.json (Chrome trace: Perfetto, chrome://tracing) and
phases_rank{r}.json (milliseconds per step of each engine phase and of communication).

Phases are the engine's `record_function` labels ("workbench.attention", ...). They nest
(forward contains router, dispatch, ...), so the breakdown lists inclusive times that do not add
up to the step. Communication is the self time of collective ops/kernels (names containing nccl,
gloo, all_to_all, all_gather, reduce_scatter, all_reduce, ...), which also overlaps the phases
that issue it. On CUDA the times are device (kernel) times, on CPU wall-clock CPU times.
Launch on a cluster with `cluster.finetune(cfg, target="workbench.train.profile:profile_finetune")`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from workbench.train.loop import finetune

PHASES = ("attention", "router", "dispatch", "experts", "combine", "optimizer", "forward", "backward")
LABEL_PREFIX = "workbench."
# c10d covers the functional collectives and their wait_tensor (time spent waiting for the network).
COMM_PATTERNS = (
    "nccl",
    "gloo",
    "all_to_all",
    "alltoall",
    "all_gather",
    "allgather",
    "reduce_scatter",
    "all_reduce",
    "allreduce",
    "broadcast",
    "c10d",
    "wait_tensor",
)
PROFILE_DIR = "profile"


def is_communication(name: str) -> bool:
    """Whether a profiler event name is a collective (op or kernel)."""
    lowered = name.lower()
    return not lowered.startswith(LABEL_PREFIX) and any(p in lowered for p in COMM_PATTERNS)


def _is_device_event(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).rsplit(".", 1)[-1] != "CPU"


def phase_breakdown(events: Any, device_type: str, steps: int) -> dict[str, Any]:
    """Milliseconds per step of each phase label and of communication, from `prof.events()`.

    Phases come from the CPU-side ranges only (a GPU copy of a range, where the profiler records
    one, would count twice): on CUDA their device time is the kernels launched inside them (with
    none, e.g. backward launched from autograd's device thread, their CPU wall time); on CPU their
    CPU time. Communication is the self time of collective events: kernels on CUDA, ops on CPU.
    """
    on_cuda = device_type == "cuda"
    phases = dict.fromkeys(PHASES, 0.0)
    found: set[str] = set()
    communication = 0.0
    self_time: dict[str, list] = {}
    for event in events:
        name = event.name
        device_event = _is_device_event(event)
        if name.startswith(LABEL_PREFIX) and name[len(LABEL_PREFIX) :] in phases:
            if not device_event:
                phase = name[len(LABEL_PREFIX) :]
                inclusive = float(event.device_time_total) if on_cuda else 0.0
                phases[phase] += inclusive if inclusive > 0 else float(event.cpu_time_total)
                found.add(phase)
            continue
        if on_cuda and not device_event:
            continue  # on GPUs the time that matters is the kernels'
        own = float(event.device_time_total if device_event else event.self_cpu_time_total)
        if is_communication(name):
            communication += own
        if not name.startswith("ProfilerStep"):
            entry = self_time.setdefault(name, [0.0, 0])
            entry[0] += own
            entry[1] += 1
    if "optimizer" not in found:  # torch labels its own optimizer steps
        for event in events:
            if event.name.startswith("Optimizer.step#") and not _is_device_event(event):
                phases["optimizer"] += float(event.cpu_time_total)
                found.add("optimizer")
    per_step = 1e-3 / max(1, steps)
    top = sorted(((t, n, c) for n, (t, c) in self_time.items()), reverse=True)[:15]
    return {
        "phases_ms": {p: phases[p] * per_step for p in PHASES if p in found},
        "missing_phases": [p for p in PHASES if p not in found],
        "communication_ms": communication * per_step,
        "top_ops": [{"name": n, "self_ms": t * per_step, "calls": c} for t, n, c in top],
    }


class ProfilerCallback:
    """Starts torch.profiler at on_start, steps it with the trainer, writes results per rank."""

    # the trainer then waits for every step, so profiler steps line up with the trainer's
    collect_every_step = True

    def __init__(self, skip_steps: int = 1, profile_steps: int | None = None) -> None:
        self.skip_steps, self.profile_steps = skip_steps, profile_steps
        self.profiler = None
        self.written: list[Path] = []

    def on_start(self, info: dict) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.rank, total = int(info["rank"]), int(info["total_steps"]) - int(info.get("start_step", 0))
        self.device_type = "cuda" if str(info.get("device", "cpu")).startswith("cuda") else "cpu"
        skip = min(self.skip_steps, max(0, total - 1))
        self.active = max(1, min(self.profile_steps or total - skip, total - skip))
        self.out_dir = Path(info["run_dir"]) / PROFILE_DIR
        self.out_dir.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        # The skipped steps are the profiler's warm-up: it is running but recording nothing kept.
        sched = schedule(wait=max(0, skip - 1), warmup=min(1, skip), active=self.active, repeat=1)
        self.profiler = profile(activities=activities, schedule=sched, on_trace_ready=self._write)
        self.profiler.start()

    def on_step(self, record: dict) -> None:
        if self.profiler is not None:
            self.profiler.step()

    def on_end(self, result: dict) -> None:
        if self.profiler is not None:
            profiler, self.profiler = self.profiler, None
            profiler.stop()

    def _write(self, prof: Any) -> None:
        trace = self.out_dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        summary = {
            "rank": self.rank,
            "device": self.device_type,
            "steps": self.active,
            "unit": "ms per step",
            "trace": str(trace),
            **phase_breakdown(prof.events(), self.device_type, self.active),
        }
        phases = self.out_dir / f"phases_rank{self.rank}.json"
        phases.write_text(json.dumps(summary, indent=2))
        self.written += [trace, phases]


def profile_finetune(
    run_config: Any, callbacks: list | None = None, skip_steps: int = 1, profile_steps: int | None = None
) -> dict[str, Any]:
    """`finetune` under torch.profiler on this rank; adds "profile_dir" to the result."""
    profiler = ProfilerCallback(skip_steps, profile_steps)
    result = finetune(run_config, callbacks=[*(callbacks or []), profiler])
    result["profile_dir"] = str(Path(result["run_dir"]) / PROFILE_DIR)
    return result
