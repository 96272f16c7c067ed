"""Half-written folders (`.tmp-<name>-<pid>`) whose writer is gone: a build or save killed before its final rename.

Writers of a folder put their work in `.tmp-<name>-<pid>` beside it and rename it into place once whole, so a
killed writer leaves that folder behind (as large as what it was writing). The next writer of the same name removes
those whose process no longer exists on this host. A leaf module: the data cache and the exports both use it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def temp_folder(folder: Path) -> Path:
    """Where this process writes `folder` before renaming it into place."""
    return folder.with_name(f".tmp-{folder.name}-{os.getpid()}")


def remove_dead_builds(folder: Path) -> list[Path]:
    """Delete `folder`'s half-written siblings whose process is gone; the ones removed."""
    removed = []
    for tmp in folder.parent.glob(f".tmp-{folder.name}-*"):
        pid = tmp.name.rsplit("-", 1)[-1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
            removed.append(tmp)
        except PermissionError:  # another user's live process
            pass
    return removed
