"""The on-disk record of one training run: config.json, status.json, metrics.jsonl, checkpoints/.

The trainer writes it (rank 0 writes config/status, every rank may append metrics); the lab
extension and notebooks read it. JSON files are replaced atomically so a reader never sees a
half-written config or status; metrics.jsonl is append-only and readers skip a torn last line.
Everything is private to the owner (directories 0700, files 0600): configs name data paths, and
checkpoints are the weights.
A live status names its owner (pid, host, heartbeat); readers call a run whose owner is gone
"died" (workbench.runs.liveness).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from workbench.runs.liveness import LIVE_STATES, checked_status, owner_fields
from workbench.runs.run_files import CONFIG_FILE, ERROR_LOG, METRICS_FILE, STATUS_FILE, skipped_note
from workbench.runs.run_names import run_id_problem

RUN_STATES = frozenset({"starting", "running", "stopping", "completed", "failed", "stopped"})
DIR_MODE = 0o700
FILE_MODE = 0o600


def default_runs_dir() -> Path:
    """$WORKBENCH_RUNS_DIR if set, else ~/moe-workbench/runs (where `workbench demo` writes)."""
    env = os.environ.get("WORKBENCH_RUNS_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / "moe-workbench" / "runs"


def new_run_id() -> str:
    """A sortable, collision-resistant id like 20261129-235959-ab12."""
    return f"{datetime.now():%Y%m%d-%H%M%S}-{secrets.token_hex(2)}"


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` is "no space left" (or over quota)."""
    return isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT)


def _atomic_write_json(path: Path, obj: Any) -> None:
    # Serialize first: a non-JSON-able value must fail before we touch the disk.
    text = json.dumps(obj, indent=2, sort_keys=False, default=_json_default)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _overwrite_json(path: Path, obj: Any) -> None:
    """Rewrite a small JSON file in place: on a full disk there is no room for a temporary copy,
    but the file's own blocks can be reused. Not atomic; only the fallback of a full disk."""
    text = json.dumps(obj, indent=2, default=_json_default)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


def _json_default(value: Any) -> Any:
    # Paths and small numpy/torch scalars show up in configs and metrics; keep them readable.
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        obj = json.load(f)
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a {type(obj).__name__}, expected a JSON object")
    return obj


@contextlib.contextmanager
def private_files() -> Iterator[None]:
    """Umask 0o077 for the block, restored after (also on error): everything a run writes,
    including DCP shards and torch.save files we do not open ourselves, is owner-only.

    The umask is per process; a notebook kernel's other threads writing meanwhile get it too.
    """
    old = os.umask(0o077)
    try:
        yield
    finally:
        os.umask(old)


def _check_writable(directory: Path) -> None:
    """Fail early, naming the path, if we cannot create files in `directory`."""
    try:
        directory.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise PermissionError(
            f"run directory {directory} is not writable ({err.strerror or err}); "
            "choose another runs_dir or set $WORKBENCH_RUNS_DIR"
        ) from err


class RunDir:
    """One run's directory: <runs_dir>/<run_id>."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.run_id = self.path.name
        # The heartbeat thread and the trainer both write; reentrant because a SIGTERM handler
        # may record the end while this thread is inside write_status.
        self._status_lock = threading.RLock()

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def checkpoints_dir(self) -> Path:
        """Where DCP / HF checkpoints of this run go."""
        return self.path / "checkpoints"

    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def status_path(self) -> Path:
        return self.path / STATUS_FILE

    @property
    def metrics_path(self) -> Path:
        return self.path / METRICS_FILE

    @classmethod
    def create(cls, runs_dir: str | os.PathLike, run_id: str | None, config: dict) -> RunDir:
        """Make a new run directory, write config.json and status.json {"state": "starting"}."""
        if not isinstance(config, dict):
            raise TypeError(f"config must be a dict (RunConfig as dict), got {type(config).__name__}")
        run_id = run_id or new_run_id()
        problem = run_id_problem(run_id)
        if problem:
            raise ValueError(problem)
        runs_dir = Path(runs_dir).expanduser()
        _check_writable(runs_dir)
        path = runs_dir / run_id
        try:
            path.mkdir(mode=DIR_MODE)
        except FileExistsError:
            raise FileExistsError(
                f"run directory {path} already exists; pick another run_id or leave it None"
            ) from None
        run = cls(path)
        _atomic_write_json(run.config_path, config)
        run.write_status("starting")
        return run

    @classmethod
    def open(cls, path: str | os.PathLike) -> RunDir:
        """Open an existing run directory (it must hold config.json or status.json)."""
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"no run directory at {path}")
        if not (path / CONFIG_FILE).exists() and not (path / STATUS_FILE).exists():
            raise FileNotFoundError(f"{path} is not a run directory (no {CONFIG_FILE} / {STATUS_FILE})")
        return cls(path)

    def write_status(self, state: str, **fields: Any) -> None:
        """Atomically replace status.json with {"state": state, **fields, "updated_at": now}.

        A live state (starting, running, stopping) also records this process as its owner. On a
        full disk the file is rewritten in place, without the traceback, rather than left stale.
        """
        if state not in RUN_STATES:
            raise ValueError(f"state {state!r} is not one of {sorted(RUN_STATES)}")
        status = {"state": state, "run_id": self.run_id, **fields}
        for key in ("error", "traceback", "reported_error"):
            if isinstance(status.get(key), str):
                status[key] = _clipped(status[key])
        status.setdefault("updated_at", time.time())
        if state in LIVE_STATES:
            status = {**owner_fields(), **status}
        with self._status_lock:
            try:
                _atomic_write_json(self.status_path, status)
            except OSError as err:
                if not is_disk_full(err):
                    raise
                _overwrite_json(self.status_path, {k: v for k, v in status.items() if k != "traceback"})

    def mark_failed(self, error: str, *, replace_failed: bool = False, **fields: Any) -> bool:
        """Record a failure seen from outside the training loop (a launcher saw a rank die, a
        signal); False if the run had already ended (a "failed" it recorded itself is kept, with
        its traceback, unless `replace_failed`)."""
        with self._status_lock:
            try:
                status = self.read_status()
            except (OSError, ValueError):
                status = {}
            state = status.get("state")
            if state in ("completed", "stopped") or (state == "failed" and not replace_failed):
                return False
            kept = _progress(status)
            if state == "failed" and status.get("error"):
                kept["reported_error"] = status["error"]  # what the surviving ranks saw
            self.write_status("failed", **kept, **fields, error=error)
            return True

    def progress(self) -> dict:
        """Step, total steps and world size from the latest status ({} if unreadable)."""
        try:
            return _progress(self.read_status())
        except (OSError, ValueError):
            return {}

    def beat(self) -> bool:
        """Refresh the heartbeat of a live status this process owns; False once it is not ours."""
        with self._status_lock:
            try:
                status = self.read_status()
            except ValueError:
                return True  # torn by a full-disk fallback write; try again next beat
            if status.get("state") not in LIVE_STATES or status.get("pid") != os.getpid():
                return False
            _atomic_write_json(self.status_path, {**status, **owner_fields()})
            return True

    def append_metrics(self, records: list[dict]) -> None:
        """Append one JSON object per line to metrics.jsonl and flush it."""
        if not records:
            return
        # Build all lines first so a bad record does not leave a partial batch behind.
        lines = "".join(json.dumps(r, default=_json_default) + "\n" for r in records)
        fd = os.open(self.metrics_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(lines)
            f.flush()

    @property
    def error_log_path(self) -> Path:
        return self.path / ERROR_LOG

    def log_error(self, rank: int, text: str) -> Path:
        """Append a failed rank's traceback to error.log (one write: ranks failing together do not interleave)."""
        entry = f"--- rank {rank}, {datetime.now():%Y-%m-%d %H:%M:%S}\n{text.rstrip()}\n"
        fd = os.open(self.error_log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
        with os.fdopen(fd, "a", encoding="utf-8") as f:
            f.write(entry)
        return self.error_log_path

    def read_config(self) -> dict:
        """The RunConfig dict this run was started with."""
        return _read_json(self.config_path)

    def read_status(self) -> dict:
        """The latest status; {"state": "unknown"} if the run never wrote one."""
        if not self.status_path.exists():
            return {"state": "unknown", "run_id": self.run_id}
        return _read_json(self.status_path)

    def read_checked_status(self) -> dict:
        """The latest status, with a live state whose owner is gone shown as "died"."""
        return checked_status(self.read_status())

    def read_metrics(self) -> list[dict]:
        """All metrics records; a garbled line is skipped with a warning naming it, not fatal.

        An unfinished last line (no newline yet) is left out silently: a live run may be writing it.
        `workbench show` and the lab read the file in chunks instead (workbench.runs.run_index).
        """
        if not self.metrics_path.exists():
            return []
        records, skipped = [], []
        with open(self.metrics_path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, 1):
                text = line.strip()
                if not text:
                    continue
                try:
                    obj = json.loads(text)
                except (json.JSONDecodeError, RecursionError):
                    obj = None  # a writer crashed mid-line or is writing right now
                if isinstance(obj, dict):
                    records.append(obj)
                elif line.endswith("\n"):
                    skipped.append(number)
        if skipped:
            warnings.warn(f"{self.path}: {skipped_note(len(skipped), skipped[:8])}", stacklevel=2)
        return records


# status.json is read on every poll of the lab's runs list, and readers refuse one over 1 MiB: an
# exception whose message holds a whole state dict must not make it that large.
STATUS_TEXT_MAX_CHARS = 32 * 2**10


def _clipped(text: str) -> str:
    """`text` within STATUS_TEXT_MAX_CHARS: its start and its end (where a traceback says what happened)."""
    if len(text) <= STATUS_TEXT_MAX_CHARS:
        return text
    half = STATUS_TEXT_MAX_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half:,} characters left out ...]\n{text[-half:]}"


def _progress(status: dict) -> dict:
    # What a failure record keeps from the live status it replaces.
    return {k: status[k] for k in ("step", "total_steps", "world_size") if k in status}
