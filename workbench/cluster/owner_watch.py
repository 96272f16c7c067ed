"""Exit a cluster process once the process that owns the cluster (a notebook's kernel) is gone.

Used by the engines' and the controller's entry scripts (engine_main.py, controller_main.py), which run by path and
import nothing of the workbench package: they import this file from its folder. Standard library only.
"""

import os
import signal
import sys
import threading
import time

# The pid of the process that started this cluster: without it an engine outlives a kernel JupyterLab killed and
# goes on training a run nobody can stop, and the controller stays behind, holding its ports, for good.
OWNER_ENV = "WORKBENCH_CLUSTER_OWNER_PID"
OWNER_POLL_S = 1.0


def owner_alive(pid: int) -> bool:
    """Whether process `pid` exists (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_owner(pid: int, what: str, poll_s: float = OWNER_POLL_S) -> None:
    """Exit this process (status 3) once `pid` is gone; a daemon thread, polling. `what` names it in the message."""

    def watch() -> None:
        while owner_alive(pid):
            time.sleep(poll_s)
        sys.stderr.write(f"workbench {what}: the cluster's owner (pid {pid}) is gone; exiting\n")
        sys.stderr.flush()
        if os.getpgrp() == os.getpid():
            # a session of its own (ipyparallel's local launchers start each process so): the processes it forked
            # go too (the controller's forked hub outlived it as an orphan)
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os._exit(3)  # a training step may hold the main thread: no clean shutdown to wait for

    threading.Thread(target=watch, name="workbench-owner-watch", daemon=True).start()


def watch_owner_from_env(what: str) -> None:
    """watch_owner for the pid in OWNER_ENV, where the cluster's starter set it."""
    if os.environ.get(OWNER_ENV, "").isdigit():
        watch_owner(int(os.environ[OWNER_ENV]), what)
