"""The cluster's controller process: ipyparallel's controller, exiting once the cluster's owner is gone.

Started by path like engine_main.py (importing nothing of the workbench package). Without the owner watch a kernel
JupyterLab killed left its controller running for good (the engines already exited), with its ports and files.
"""

import os
import sys

if __name__ == "__main__":
    # `python -m ipyparallel.controller` puts the working folder first on sys.path; this file's folder would shadow
    # top-level modules with the cluster package's names
    sys.path[0] = os.getcwd()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # for owner_watch.py alone (stdlib only)
    import owner_watch

    del sys.path[0]
    owner_watch.watch_owner_from_env("controller")

    from ipyparallel.controller.app import main

    main()
