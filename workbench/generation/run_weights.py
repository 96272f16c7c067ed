"""Which weights a run has to answer with: its Transformers export (hf/) or its latest complete step-* checkpoint.

A run folder is written by one run, so its hf/ export (written once, at the end of a completed run with
train.export_hf, after its last checkpoint) holds its final weights; otherwise its newest complete
step-* checkpoint does (a step-* folder is complete once it has its name, and never rewritten, so one
of a run still training is safe to read). A run is named by its folder or by its id in a runs directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from workbench.config_checks import ConfigError
from workbench.models.export_folder import MODEL_FILES
from workbench.runs.run_dir import RunDir, default_runs_dir
from workbench.runs.run_files import CONFIG_FILE, STATUS_FILE
from workbench.runs.run_names import run_id_problem, shown_id
from workbench.train.checkpoint_files import list_checkpoints

EXPORT_DIR = "hf"  # where train.export_hf writes (workbench.train.loop)
EXPORT = "export"
CHECKPOINT = "checkpoint"


@dataclass(frozen=True)
class RunWeights:
    """One run's latest weights: `source` is EXPORT (a Transformers folder) or CHECKPOINT (a step-* folder)."""

    run_dir: Path
    source: str
    path: Path

    def __post_init__(self) -> None:
        if self.source not in (EXPORT, CHECKPOINT):
            raise ValueError(f"source must be {EXPORT!r} or {CHECKPOINT!r}, got {self.source!r}")

    def describe(self) -> str:
        """A line naming the run and the folder its weights come from."""
        kind = "its Transformers export" if self.source == EXPORT else "its latest checkpoint"
        return f"run {self.run_dir.name}: {kind} {self.path}"


def find_run_dir(run: str | os.PathLike, runs_dir: str | os.PathLike | None = None) -> Path:
    """The folder of `run` (a run folder, or a run id in `runs_dir`); ConfigError saying how to find one."""
    where = Path(runs_dir).expanduser() if runs_dir else default_runs_dir()
    path = Path(run).expanduser()
    if not path.is_dir():
        problem = run_id_problem(str(run))
        if problem:
            raise ConfigError(f"no run {shown_id(str(run))}: not a run folder, and {problem}")
        path = where / str(run)
    if not path.is_dir():
        raise ConfigError(
            f"no run {shown_id(str(run))}: neither a folder nor a run id in {where} "
            "(`workbench runs` lists them; --runs-dir or $WORKBENCH_RUNS_DIR names another runs directory)"
        )
    if not (path / CONFIG_FILE).is_file():
        raise ConfigError(
            f"{path} is not a run folder: it has no {CONFIG_FILE} (pass a folder a run wrote, or its id; "
            "`workbench runs` lists them)"
        )
    return path


def has_export(folder: Path) -> bool:
    """Whether `folder` holds a whole Transformers model (its config and its weights)."""
    return (folder / MODEL_FILES[0]).is_file() and any((folder / name).is_file() for name in MODEL_FILES[1:])


def latest_weights(run_dir: str | os.PathLike) -> RunWeights:
    """The run's export if it has one, else its newest complete checkpoint; ConfigError when it has neither yet."""
    run_dir = Path(run_dir)
    export = run_dir / EXPORT_DIR
    if has_export(export):
        return RunWeights(run_dir, EXPORT, export)
    found = list_checkpoints(RunDir(run_dir).checkpoints_dir)
    if found:
        return RunWeights(run_dir, CHECKPOINT, found[-1])
    state = _state(run_dir)
    raise ConfigError(
        f"run {run_dir.name} ({state}) has no weights yet: no complete checkpoint under "
        f"{run_dir / 'checkpoints'} and no export in {export}. A run saves them every train.checkpoint_every "
        "steps and at its end (train.save_final_checkpoint, train.export_hf): wait for its first checkpoint, "
        "or pick a run `workbench runs` shows as completed"
    )


def _state(run_dir: Path) -> str:
    try:
        return str(RunDir(run_dir).read_checked_status().get("state", "unknown"))
    except (OSError, ValueError):
        return f"no readable {STATUS_FILE}"


def runs_with_weights(runs_dir: str | os.PathLike) -> list[RunWeights]:
    """The latest weights of every run in `runs_dir` that has some, the most recently written first."""
    root = Path(runs_dir).expanduser()
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.is_dir() and not run_id_problem(path.name) and (path / CONFIG_FILE).is_file():
            try:
                found.append(latest_weights(path))
            except ConfigError:
                continue  # no weights yet: nothing to try
    return sorted(found, key=lambda w: (w.path.stat().st_mtime, w.run_dir.name), reverse=True)
