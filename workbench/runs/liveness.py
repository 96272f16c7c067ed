"""Is the process that owns a "running" status still there?

A run killed with SIGKILL (or the OOM killer, or a lost machine) cannot write its own failure,
so status.json would say "running" for good. Rank 0 therefore records who owns the run (pid,
its start time, host, boot id) and refreshes a heartbeat time while it lives; readers turn a
live state whose owner is gone into "died". On the owner's machine the pid decides, at once (a
live pid with a late heartbeat is a busy process, not a dead one); elsewhere the heartbeat does:
older than STALE_AFTER_S is dead.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

LIVE_STATES = frozenset({"starting", "running", "stopping"})
DIED = "died"
HEARTBEAT_S = 2.0
# Five missed beats: a busy 2-core machine never delays a daemon thread that long, and a reader
# on another machine still says "died" within 10 s of the last beat.
STALE_AFTER_S = 10.0


def _proc_stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name (state first), or None without /proc."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[-1].split()
    except OSError:
        return None


def _process_start(pid: int) -> int | None:
    # Field 22 (starttime, clock ticks after boot): a reused pid has another one.
    fields = _proc_stat(pid)
    return int(fields[19]) if fields and len(fields) > 19 and fields[19].isdigit() else None


def _boot_id() -> str | None:
    # Two machines may share a host name (a default image); they never share a boot id.
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip() or None
    except OSError:
        return None


def owner_fields(now: float | None = None) -> dict[str, Any]:
    """The fields a live status carries so that readers can tell whether its writer still lives."""
    pid = os.getpid()
    return {
        "pid": pid,
        "pid_start": _process_start(pid),
        "host": socket.gethostname(),
        "boot_id": _boot_id(),
        "heartbeat_at": time.time() if now is None else now,
    }


def pid_alive(pid: int | None, start: int | None = None) -> bool:
    """Whether process `pid` runs on this machine (not a zombie; the same process if `start`,
    its recorded start time, is given)."""
    if not pid or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    fields = _proc_stat(pid)
    if fields is None:
        return True  # gone between the two looks, or no /proc (macOS): kill(0) is all we know
    if fields[0] in ("Z", "X"):  # killed, and nobody reaped it yet
        return False
    return start is None or _process_start(pid) in (None, start)


def _on_this_machine(status: dict) -> bool:
    if status.get("host") != socket.gethostname():
        return False
    theirs, ours = status.get("boot_id"), _boot_id()
    return theirs is None or ours is None or theirs == ours


def death_reason(status: dict, now: float | None = None) -> str | None:
    """Why the owner of a live `status` is dead, or None (alive, finished, or not recorded)."""
    if status.get("state") not in LIVE_STATES:
        return None
    pid, host, beat = status.get("pid"), status.get("host"), status.get("heartbeat_at")
    if isinstance(pid, int) and _on_this_machine(status):
        start = status.get("pid_start")
        if pid_alive(pid, start if isinstance(start, int) else None):
            return None
        return f"its process (pid {pid} on {host}) is gone without recording an end"
    if isinstance(beat, (int, float)):
        age = (time.time() if now is None else now) - beat
        if age > STALE_AFTER_S:
            return f"no heartbeat for {age:.0f} s (owner pid {pid} on {host})"
    return None


def checked_status(status: dict, now: float | None = None) -> dict:
    """`status` as a reader should show it: a live state with a dead owner becomes "died"."""
    reason = death_reason(status, now)
    if reason is None:
        return status
    last = status["state"]
    step = status.get("step")
    at = f" at step {step}" if step is not None else ""
    return {**status, "state": DIED, "recorded_state": last, "error": f"the run died while {last}{at}: {reason}"}


class Heartbeat:
    """A daemon thread calling `beat()` every `interval` seconds until `stop()`."""

    def __init__(self, beat: Callable[[], bool], interval: float = HEARTBEAT_S) -> None:
        if not interval > 0:
            raise ValueError(f"heartbeat interval must be > 0 s, got {interval}")
        self._beat = beat
        self.interval = interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="workbench-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop beating and wait for the thread (a beat in progress finishes first)."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join()

    def _loop(self) -> None:
        while not self._stopped.wait(self.interval):
            try:
                if not self._beat():
                    return  # the status is no longer ours to refresh
            except OSError:
                continue  # a full disk now must not kill the thread; the next beat may succeed

    def __enter__(self) -> Heartbeat:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


@contextlib.contextmanager
def record_termination(on_signal: Callable[[str], None]) -> Iterator[None]:
    """While the block runs, SIGTERM first calls on_signal("SIGTERM"), then ends the process as
    it would have anyway (same signal, same exit status). Launchers (torchrun, mp.spawn) stop the
    surviving ranks this way when one fails; without this the run would read "running" to the end.

    Only on the main thread, and only where SIGTERM has no handler yet (a notebook kernel's or an
    engine's own handler is left alone).
    """
    if (
        threading.current_thread() is not threading.main_thread()
        or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signum, signal.SIG_DFL)
        try:
            on_signal(signal.Signals(signum).name)
        finally:
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
