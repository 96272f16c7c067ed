"""The trackers train.report_to may name, what each needs installed, and how one is opened.

A leaf: the config check (workbench.config_train) reads TRACKERS and `missing_packages` without importing any
tracker's library; `open_tracker` imports the tracker's module (and so its library) only when a run opens it.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

# How to install every tracker's libraries, as the README installs the workbench (an editable checkout)
INSTALL_EXTRA = "pip install -e '.[trackers]' in the moe-workbench checkout"


@dataclass(frozen=True)
class TrackerSpec:
    """One tracker: the workbench module that drives it and the importable libraries it needs."""

    module: str  # defines `open_run(run_dir, run_name, config) -> Tracker`
    libraries: tuple[str, ...]  # import names
    packages: tuple[str, ...]  # their pip names, in the same order


TRACKERS = {
    "tensorboard": TrackerSpec("workbench.trackers.tensorboard_tracker", ("tensorboard",), ("tensorboard",)),
    "wandb": TrackerSpec("workbench.trackers.wandb_tracker", ("wandb",), ("wandb",)),
    # mlflow-skinny's client with its SQLite store (SQLAlchemy and Alembic build the database)
    "mlflow": TrackerSpec(
        "workbench.trackers.mlflow_tracker",
        ("mlflow", "sqlalchemy", "alembic"),
        ("mlflow-skinny", "sqlalchemy", "alembic"),
    ),
}


class Tracker(Protocol):
    """What a tracker module's `open_run` returns."""

    def log(self, scalars: dict[str, float], step: int) -> None: ...

    def close(self, state: str) -> None: ...


def missing_packages(name: str) -> list[str]:
    """The pip packages of the libraries tracker `name` needs that are not installed (found without importing)."""
    spec = TRACKERS[name]
    return [pkg for lib, pkg in zip(spec.libraries, spec.packages) if importlib.util.find_spec(lib) is None]


def open_tracker(name: str, run_dir: Path, run_name: str, config: dict[str, Any]) -> Tracker:
    """Tracker `name` writing under `run_dir`, for the run called `run_name` with `config` (RunConfig as a dict)."""
    return importlib.import_module(TRACKERS[name].module).open_run(run_dir, run_name, config)
