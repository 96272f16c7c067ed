"""A real run directory for the lab tests, written by a real `workbench demo` (2 CPU ranks).

`make_run_dir(tmp_path)` copies one session-wide demo run into tmp_path/runs; `python make_run.py
<runs_dir>` runs the demo into <runs_dir> and prints the run id (extensions/ci.sh uses it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

RUN_ID = "demo-run"


def run_demo(runs_dir: Path, steps: int = 3, run_id: str = RUN_ID) -> str:
    """`workbench demo` into runs_dir; returns the run id."""
    cmd = [sys.executable, "-m", "workbench.cli", "demo", "--steps", str(steps), "--ranks", "2",
           "--output-dir", str(runs_dir), "--run-id", run_id]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ})
    if done.returncode != 0:
        raise RuntimeError(f"workbench demo failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return run_id


@lru_cache(maxsize=1)
def _session_run() -> Path:
    runs_dir = Path(tempfile.mkdtemp(prefix="mwb-demo-runs-"))
    run_demo(runs_dir)
    return runs_dir / RUN_ID


def make_run_dir(tmp_path: Path) -> tuple[Path, str]:
    """A copy of the session's real demo run under tmp_path/runs; returns (runs_dir, run_id)."""
    runs_dir = Path(tmp_path) / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(_session_run(), runs_dir / RUN_ID)
    return runs_dir, RUN_ID


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python make_run.py <runs_dir>")
    print(run_demo(Path(sys.argv[1])))
