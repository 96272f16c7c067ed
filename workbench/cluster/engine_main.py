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
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for owner_watch.py alone (stdlib only)
    import owner_watch

    del sys.path[0]
    owner_watch.watch_owner_from_env("engine")
    WorkbenchEngine.launch_instance()
