"""The process of each rank's engine: ipyparallel's IPEngine, ending cleanly when it is stopped.

Started by path (`python .../engine_main.py`), not with `-m`: `-m` would import the `workbench`
package first, which imports transformers (seconds per engine). So this file imports nothing of
the workbench.
"""

import os
import sys

if __name__ == "__main__":
    # Like `python -m ipyparallel.engine`: the working folder first on sys.path (a notebook's own
    # modules stay importable by the engines), not this file's folder (its module names would
    # shadow top-level ones).
    sys.path[0] = os.getcwd()

from ipyparallel.engine.app import IPEngine

# The pid of the process that started this cluster (the notebook's kernel): an engine outlives it
# otherwise, e.g. when JupyterLab kills a kernel, and goes on training a run nobody can stop.
OWNER_ENV = "WORKBENCH_CLUSTER_OWNER_PID"
OWNER_POLL_S = 1.0


def _owner_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_owner(pid: int, poll_s: float = OWNER_POLL_S) -> None:
    """Exit this process (status 3) once `pid` is gone; a daemon thread, polling."""
    import threading
    import time

    def watch() -> None:
        while _owner_alive(pid):
            time.sleep(poll_s)
        sys.stderr.write(f"workbench engine: the cluster's owner (pid {pid}) is gone; exiting\n")
        sys.stderr.flush()
        os._exit(3)  # a training step may hold the main thread: no clean shutdown to wait for

    threading.Thread(target=watch, name="workbench-owner-watch", daemon=True).start()


class WorkbenchEngine(IPEngine):
    """IPEngine whose stop by SIGTERM exits 0 without a traceback.

    ipyparallel's SIGTERM handler stops the event loop that `IPEngine.start` runs with
    `loop.run_sync`, and expects the TimeoutError that older tornado raised then. Tornado 6.6
    raises RuntimeError("Event loop stopped before Future completed."): every stopped engine
    printed that traceback and exited 1, so each watcher of the cluster (the JupyterLab server's
    cluster list, a notebook at log level WARNING) logged it as a failure on every stop.
    """

    _stop_requested = False

    def _signal_stop(self, sig, frame):
        self._stop_requested = True
        super()._signal_stop(sig, frame)

    def start(self):
        try:
            super().start()
        except RuntimeError:
            if not self._stop_requested:
                raise  # the loop ended for another reason: a real failure


if __name__ == "__main__":
    if os.environ.get(OWNER_ENV, "").isdigit():
        watch_owner(int(os.environ[OWNER_ENV]))
    WorkbenchEngine.launch_instance()
