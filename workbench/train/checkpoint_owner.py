"""The run a checkpoint belongs to, and whether that run is still alive (a resume must not disturb it).

A run's checkpoints live in `<run>/checkpoints/step-*`; while the run trains it writes the next save
into `.tmp-step-*` beside them. Whether it still trains is what the run's status.json says once its
owner has been checked (workbench.runs.liveness: the pid on its own machine, the heartbeat elsewhere).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workbench.runs.liveness import LIVE_STATES
from workbench.runs.run_dir import RunDir
from workbench.runs.run_files import STATUS_FILE


def owning_run(ckpt: Path) -> Path | None:
    """The run directory of checkpoint directory `ckpt` (`<run>/checkpoints/step-*`), or None outside a run."""
    run = Path(ckpt).parent.parent
    if (run / STATUS_FILE).is_file() and RunDir(run).checkpoints_dir == Path(ckpt).parent:
        return run
    return None


def live_status(ckpt: Path) -> dict[str, Any] | None:
    """The checked status of the run that holds `ckpt` while that run is alive; None when it ended, died,
    or `ckpt` is not inside a run."""
    run = owning_run(ckpt)
    if run is None:
        return None
    try:
        status = RunDir(run).read_checked_status()
    except (OSError, ValueError):
        return None  # no readable status: as the run list shows it, not a live run
    return status if status.get("state") in LIVE_STATES else None


def describe_live(run: Path, status: dict[str, Any]) -> str:
    """'<run> is still running (step 3 of 10, pid 123 on host)': a live run as a message names it."""
    step, total = status.get("step"), status.get("total_steps")
    where = f"step {step}" + (f" of {total}" if total else "") if step is not None else "no step yet"
    owner = f", pid {status.get('pid')} on {status.get('host')}" if status.get("pid") else ""
    return f"{run} is still {status.get('state')} ({where}{owner})"
