"""Weights & Biases: an offline run in <run>/wandb (`wandb sync` uploads it later), unless WANDB_MODE says otherwise.

Offline is the default so that a run sends nothing anywhere unless its user asks: WANDB_MODE=online (after
`wandb login`) logs live instead. WANDB_PROJECT names the project (default "moe-workbench").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import wandb

DEFAULT_PROJECT = "moe-workbench"


class WandbTracker:
    def __init__(self, run: Any) -> None:
        self.run = run

    def log(self, scalars: dict[str, float], step: int) -> None:
        self.run.log(scalars, step=step)

    def close(self, state: str) -> None:
        self.run.finish(exit_code=0 if state in ("completed", "stopped") else 1)


def open_run(run_dir: Path, run_name: str, config: dict[str, Any]) -> WandbTracker:
    settings = wandb.Settings(
        console="off",  # the run's own stdout stays the trainer's (progress bar, step lines)
        x_disable_stats=True,  # no system-metrics sampler process
        disable_git=True,
        save_code=False,
        silent=True,
    )
    run = wandb.init(
        project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
        name=run_name,
        dir=str(run_dir),  # wandb writes <dir>/wandb/
        config=config,
        mode=os.environ.get("WANDB_MODE") or "offline",
        reinit="create_new",  # a notebook kernel may run several runs: each gets its own
        settings=settings,
    )
    return WandbTracker(run)
