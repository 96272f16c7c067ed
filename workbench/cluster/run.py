"""`Run`: the notebook's handle on one training run across the ranks of a `Cluster`.

The engines run `workbench.train.finetune` through `apply_async` (one task per rank) and publish
each step record once over ipyparallel's data channel; a watcher thread (run_watch.RunWatcher) keeps them in the
run's one `RecordStore`, reads the records it missed between polls from metrics.jsonl, notices
failed ranks and dead engines, and feeds subscribers (live plots, the progress bar). The run
directory on disk stays the record of truth after the kernel is gone.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import workbench.cluster.engine as engine_code
from workbench.cluster.errors import RankError
from workbench.cluster.records import GapFiller, RecordStore
from workbench.cluster.run_watch import ENDED_STATES, FAILURE_GRACE_S, TERMINAL_STATES, RunWatcher
from workbench.runs.liveness import DIED, pid_alive
from workbench.runs.run_dir import RunDir, default_runs_dir, new_run_id

__all__ = ["ENDED_STATES", "FAILURE_GRACE_S", "TERMINAL_STATES", "RankError", "Run"]


class Run(RunWatcher):
    """A training run: `status`, `done`, `progress`, `stop()`, `wait()`, `metrics`, live stream."""

    def __init__(
        self, path: str | os.PathLike, *, cluster: Any = None, results: list | None = None, poll_interval: float = 0.1
    ) -> None:
        self.path = Path(path)
        self.run_id = self.path.name
        self._run_dir = RunDir(self.path)
        self._cluster = cluster
        self._results = results or []  # one AsyncResult per rank, index == rank
        self._store = RecordStore(len(self._results) or None)  # from_dir: the ranks on disk
        self._published: dict[int, int] = {}  # per rank: records the engine says it has sent
        self._gaps = GapFiller(self._store, self._run_dir.metrics_path)
        self._errors: dict[int, str] = {}
        self._dead_ranks: set[int] = set()  # ranks whose engine died: the likely root cause
        self._subscribers: list[Callable[[list[dict]], None]] = []
        self._lock = threading.RLock()
        self._done = threading.Event()
        self._settled = threading.Event()  # done, and subscribers told so
        self._state = "starting"
        self._first_failure_at: float | None = None
        self._engine_pids: dict[int, int] = {}
        self._progress = None
        self._sent_config: dict | None = None
        self.poll_interval = poll_interval
        self._watcher: threading.Thread | None = None

    # -- construction ----------------------------------------------------------------------
    @classmethod
    def launch(
        cls,
        cluster: Any,
        run_config: Any,
        *,
        target: str = "workbench.train:finetune",
        load_every: int = 10,
        poll_interval: float = 0.1,
    ) -> Run:
        """Send the run to every rank (non-blocking) and start watching it.

        Every `load_every` steps (and the last) the ranks send their expert-load matrices with the
        record; the watcher looks at the ranks every `poll_interval` seconds.
        """
        from workbench.config import RunConfig  # torch: `from workbench.cluster import Cluster` stays without it

        if not isinstance(run_config, RunConfig):
            raise TypeError(f"cluster.finetune needs a workbench.RunConfig, got {type(run_config).__name__}")
        cluster.check_ranks()  # first: a dead rank's stranded task also makes the cluster look busy
        if cluster.busy:
            raise RuntimeError("the cluster is still busy with another run; wait() for it or cluster.restart()")
        # Settle where the run lives now, so the notebook knows the directory before rank 0 makes it.
        output_dir = str(Path(run_config.output_dir or default_runs_dir()).expanduser().resolve())
        run_config = run_config.replace(output_dir=output_dir, run_id=run_config.run_id or new_run_id())
        path = Path(output_dir) / run_config.run_id
        if path.exists():
            raise FileExistsError(f"run directory {path} already exists; pick another run_id")
        cluster.ensure_process_group()
        config = run_config.to_dict()
        try:
            results = [
                cluster.client[cluster.engine_id(rank)].apply_async(
                    engine_code.run_finetune, config, target, load_every
                )
                for rank in range(cluster.world_size)
            ]
        except KeyError:  # an engine left the controller since ensure_process_group: say which rank
            cluster.check_ranks()
            raise
        run = cls(path, cluster=cluster, results=results, poll_interval=poll_interval)
        run._sent_config = config
        run._engine_pids = cluster.local_engine_pids()
        run._watcher = threading.Thread(target=run._watch, name=f"run-watcher-{run.run_id}", daemon=True)
        run._watcher.start()
        return run

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> Run:
        """Reopen a run directory read-only (e.g. after a kernel restart); a run whose owner
        process is gone without recording an end has state "died"."""
        run = cls(RunDir.open(path).path)
        run._state = run._run_dir.read_checked_status().get("state", "unknown")
        run._store.add(run._run_dir.read_metrics(), "disk")
        if run._state in ENDED_STATES:
            run._done.set()
        return run

    def __repr__(self) -> str:
        return f"Run({self.run_id!r}, state={self.state!r}, steps={self.last_step})"

    # -- public API --------------------------------------------------------------------------
    @property
    def state(self) -> str:
        """One of starting, running, stopping, completed, stopped, failed; a reopened run: died."""
        return self._state

    @property
    def status(self) -> dict:
        """status.json merged with what the notebook sees: state, step, failed ranks, engines."""
        disk = self._read_disk_status()
        status = {
            **disk,
            "state": self._state,
            "run_id": self.run_id,
            "path": str(self.path),
            "step": self.last_step,
            "done": self.done,
        }
        if self._errors:
            status["failed_ranks"] = sorted(r for r in self._errors if r >= 0)
        if self._engine_pids:
            status["engines_alive"] = {r: pid_alive(p) for r, p in self._engine_pids.items()}
        return status

    @property
    def done(self) -> bool:
        """Whether the run has finished (completed, stopped or failed)."""
        if not self._results and not self._done.is_set():  # from_dir: follow the disk
            state = self._read_disk_status().get("state")
            if state in ENDED_STATES:
                self._state = state
                self._done.set()
        return self._done.is_set()

    @property
    def config(self) -> dict:
        """The RunConfig dict (as sent to the ranks, else as the trainer recorded it)."""
        return self._sent_config if self._sent_config is not None else self._run_dir.read_config()

    @property
    def total_steps(self) -> int | None:
        try:
            return int(self.config["train"]["steps"])
        except (OSError, KeyError, TypeError, ValueError):
            return None

    @property
    def last_step(self) -> int | None:
        return self._store.last_step()

    @property
    def records(self) -> list[dict]:
        """Every step record received so far from every rank, ordered by (step, rank).

        The expert-load matrix is only on the latest step every rank has one for (and newer ones):
        the plots show that one; `metrics` and metrics.jsonl have every step's.
        """
        return self._store.records()

    @property
    def metrics(self):
        """A pandas DataFrame of every step from every rank (the trainer's field names), read
        from metrics.jsonl with every step's expert-load matrix; the streamed records without a
        run directory."""
        import pandas as pd

        if not self._run_dir.metrics_path.exists():
            return pd.DataFrame(self.records)
        by_key = {
            (int(r["rank"]), int(r["step"])): r for r in self._run_dir.read_metrics() if "rank" in r and "step" in r
        }
        for record in self.records:  # a record streamed but not (yet) readable on disk
            by_key.setdefault((int(record["rank"]), int(record["step"])), record)
        return pd.DataFrame([by_key[k] for k in sorted(by_key, key=lambda k: (k[1], k[0]))])

    @property
    def delivery(self) -> dict[str, int]:
        """How many records arrived live ("stream") or were read from metrics.jsonl ("disk")."""
        return self._store.sources

    @property
    def error(self) -> RankError | None:
        """The failure as a RankError (lowest failed rank first), or None."""
        ranks = sorted(r for r in self._errors if r >= 0)
        if not ranks:
            return None
        # A dead engine explains its peers' broken collectives, so it is named first.
        primary = min(self._dead_ranks) if self._dead_ranks else ranks[0]
        return RankError(primary, self._errors[primary], {r: self._errors[r] for r in ranks})

    def wait(self, timeout: float | None = None) -> dict:
        """Block until the run ends; return its status or raise the failing rank's RankError."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.done:
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"run {self.run_id} still {self.state} after {timeout} s")
            self._done.wait(0.2 if remaining is None else min(0.2, remaining))
        if self._results:
            self._settled.wait(5)
        if self._state in ("failed", DIED):
            raise self.error or RuntimeError(f"run {self.run_id} {self._state}: {self._read_disk_status()}")
        return self.status

    def stop(self, wait: bool = True, timeout: float | None = 120.0) -> dict:
        """Ask rank 0 to stop at the next step boundary (it then checkpoints); optionally wait."""
        if not self._results:
            raise RuntimeError("this Run was reopened from disk and is read-only")
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        # The trainer makes the run directory; the flag file goes inside it once it exists.
        while not self.path.is_dir() and not self.done:
            if time.monotonic() > deadline:
                raise TimeoutError(f"run directory {self.path} did not appear within {timeout} s")
            time.sleep(0.05)
        if not self.done:
            (self.path / engine_code.STOP_FILE).write_text(f"{time.time()}\n")
            if self._state == "running":
                self._state = "stopping"
        if wait:
            remaining = max(0.0, deadline - time.monotonic()) if timeout is not None else None
            return self.wait(remaining)
        return self.status

    def on_metrics(self, fn: Callable[[list[dict]], None]) -> Callable[[], None]:
        """Call fn(new_records) from the watcher thread as records arrive; returns unsubscribe."""
        with self._lock:
            self._subscribers.append(fn)
            backlog = self.records
        if backlog:
            fn(backlog)

        def unsubscribe() -> None:
            if fn in self._subscribers:
                self._subscribers.remove(fn)

        return unsubscribe

    def stream(self, timeout: float | None = None) -> Iterator[dict]:
        """Yield every record (past ones first) as it arrives, until the run is done."""
        inbox: queue.Queue = queue.Queue()
        unsubscribe = self.on_metrics(lambda records: inbox.put(records))
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                try:
                    batch = inbox.get(timeout=0.1)
                except queue.Empty:
                    if self.done and inbox.empty():
                        return
                    if deadline is not None and time.monotonic() > deadline:
                        raise TimeoutError(f"no end of run {self.run_id} within {timeout} s") from None
                    continue
                yield from batch
        finally:
            unsubscribe()

    def __iter__(self) -> Iterator[dict]:
        return self.stream()

    @property
    def progress(self):
        """An ipywidgets progress bar with step, seconds per step and ETA (created on first use)."""
        if self._progress is None:
            from workbench.ui.progress import RunProgress  # the notebook's widget: UI, imported on first use

            self._progress = RunProgress(self)
        return self._progress.widget
