"""Stop a checkpoint save where a crash or a full disk would: its shards written, nothing renamed.

The fault replaces the save's first write after the shards (trainer_state.json into the
`.tmp-step-*` directory), so the real save runs up to that point and stops there.
`fail_save_at(monkeypatch, step, fault)` does it in this process; `python tests/save_faults.py
FAULT STEP <workbench CLI args>` runs the real CLI with the fault installed (for a subprocess run).
"""

from __future__ import annotations

import errno
import os
import signal
import sys

from workbench.train import checkpoint

FAULTS = ("error", "disk_full", "kill")


def _faulty_write(write, step: int, fault: str):
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {FAULTS}, got {fault!r}")
    target = f".tmp-{checkpoint.step_dir_name(step)}"

    def faulty(path, obj):
        if path.parent.name == target:
            if fault == "error":
                raise RuntimeError(f"failing on purpose while saving step {step}")
            if fault == "disk_full":
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
            os.kill(os.getpid(), signal.SIGKILL)  # nothing after this line runs, as on a real kill
        write(path, obj)

    return faulty


def fail_save_at(monkeypatch, step: int, fault: str) -> None:
    """Make the save of checkpoint `step` stop with `fault` ("error", "disk_full" or "kill")."""
    monkeypatch.setattr(checkpoint, "_write_json", _faulty_write(checkpoint._write_json, step, fault))


if __name__ == "__main__":
    fault, step, *cli_args = sys.argv[1:]
    checkpoint._write_json = _faulty_write(checkpoint._write_json, int(step), fault)
    from workbench.cli import main

    sys.exit(main(cli_args))
