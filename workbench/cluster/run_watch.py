"""The watcher half of `Run`: polling the ranks' tasks and published records, failures, the run's state."""

from __future__ import annotations

import time

from workbench.cluster.errors import describe_remote_error
from workbench.runs.liveness import DIED, pid_alive

TERMINAL_STATES = frozenset({"completed", "failed", "stopped"})
# A reopened run also ends when its owner is gone without recording an end (liveness).
ENDED_STATES = TERMINAL_STATES | {DIED}
# After one rank fails, give the others this long to fail too (their tracebacks, the trainer's
# status.json) before the run counts as done; a rank stuck in a collective never does. 3 s was too
# short on a loaded 2-core machine (OMP_NUM_THREADS=2): the second rank's data error came later.
FAILURE_GRACE_S = 10.0


class RunWatcher:
    """Mixin of workbench.cluster.run.Run: what its watcher thread does each poll, and how the run ends.

    Reads and writes the state Run.__init__ makes (_results, _store, _published, _gaps, _errors,
    _dead_ranks, _subscribers, _lock, _done, _settled, _state, _first_failure_at, _engine_pids),
    and reads its path, _run_dir, poll_interval and error.
    """

    def _watch(self) -> None:
        while not self._done.is_set():
            try:
                with self._lock:  # on_metrics takes its backlog under it: no record twice, none missed
                    self._poll()
            except Exception as err:  # never let the watcher die silently
                self._errors.setdefault(-1, f"run watcher error: {type(err).__name__}: {err}")
            time.sleep(self.poll_interval)

    def _poll(self) -> None:
        new: list[dict] = []
        for rank, ar in enumerate(self._results):
            new += self._take_stream(rank, ar.data or {})
            if ar.ready() and rank not in self._errors and not hasattr(ar, "_wb_collected"):
                ar._wb_collected = True
                try:
                    result = ar.get(timeout=0)
                except Exception as err:
                    if "EngineError" in (type(err).__name__, getattr(err, "ename", None)):
                        self._fail(rank, f"the engine process of rank {rank} died: {err}", died=True)
                    else:
                        self._fail(rank, describe_remote_error(err))
                else:
                    if isinstance(result, dict) and isinstance(result.get("published"), int):
                        self._published[rank] = max(self._published.get(rank, 0), result["published"])
        for rank, pid in self._engine_pids.items():
            if pid and rank not in self._errors and not pid_alive(pid) and not self._results[rank].ready():
                self._fail(rank, f"the engine process of rank {rank} (pid {pid}) died", died=True)
        new += self._fill_gaps()
        if new:
            self._notify(new)
        self._update_state()

    def _take_stream(self, rank: int, data: dict) -> list[dict]:
        """The records of rank's latest message that are new here (ipyparallel keeps only the latest)."""
        last = data.get("last_seq")
        seen = self._published.get(rank, 0)
        if not isinstance(last, int) or last <= seen:
            return []
        records = data.get("records", [])
        skip = max(0, seen + 1 - int(data.get("first_seq", 1)))  # only after a resent range
        self._published[rank] = last
        return self._store.add(records[skip:], "stream")

    def _fill_gaps(self) -> list[dict]:
        """The records ranks published that never arrived (replaced between polls), from metrics.jsonl."""
        return self._gaps.fill(self._published)

    def _fail(self, rank: int, traceback: str, died: bool = False) -> None:
        with self._lock:
            self._errors[rank] = traceback
            if died:
                self._dead_ranks.add(rank)
            if self._first_failure_at is None:
                self._first_failure_at = time.monotonic()
                self._state = "failed"

    def _update_state(self) -> None:
        all_ready = all(ar.ready() for ar in self._results)
        disk = self._read_disk_status()
        if self._first_failure_at is not None:
            if all_ready or time.monotonic() - self._first_failure_at > FAILURE_GRACE_S:
                self._mark_failed_on_disk(disk)
                self._finish()
            return
        if all_ready:
            state = disk.get("state")
            self._state = state if state in TERMINAL_STATES else "completed"
            self._finish()
        elif disk.get("state") in ("starting", "running", "stopping"):
            self._state = disk["state"]

    def _read_disk_status(self) -> dict:
        try:
            if not self.path.is_dir():
                return {}
            # Reopened from disk: nobody watches the ranks, so judge the owner's liveness here.
            return self._run_dir.read_status() if self._results else self._run_dir.read_checked_status()
        except (OSError, ValueError):
            return {}

    def _mark_failed_on_disk(self, disk: dict) -> None:
        # A killed rank 0 cannot write its own failure; keep the on-disk record truthful.
        if self.path.is_dir() and disk.get("state") not in TERMINAL_STATES:
            error = self.error
            rank = error.rank if error else -1
            try:
                self._run_dir.write_status(
                    "failed", rank=rank, error=error.traceback[-2000:] if error else "", detected_by="notebook"
                )
            except OSError:
                pass

    def _finish(self) -> None:
        new = self._fill_gaps()
        self._done.set()
        self._notify(new)  # subscribers (progress bar, plots) see the final state
        self._settled.set()

    def _notify(self, records: list[dict]) -> None:
        for fn in list(self._subscribers):
            try:
                fn(records)
            except Exception:
                pass  # a broken plot must not stop the run's bookkeeping
