"""A real run directory for the lab tests, written by a real `workbench demo` (2 CPU ranks).

`make_run_dir(tmp_path)` copies one session-wide demo run into tmp_path/runs; `python make_run.py
<runs_dir>` runs the demo into <runs_dir> and prints the run id (extensions/ci.sh uses it).
"""

from __future__ import annotations

import json
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


def trainer_records(first_step: int, count: int) -> list[dict]:
    """Records shaped like the trainer's (both ranks, an expert-load matrix), loss falling with step."""
    return [{"step": s, "rank": rank, "loss": 10.0 / s, "tokens_per_s_per_gpu": 1000.0 + s,
             "expert_load": [[s % 97] * 8] * 2, "time": 1.0 * s}
            for s in range(first_step, first_step + count) for rank in (0, 1)]


def append_records(path: Path, records: list[dict]) -> int:
    """Append records as the trainer does (one JSON object per line); returns the bytes written."""
    return append_text(path, "".join(json.dumps(r) + "\n" for r in records))


def append_text(path: Path, text: str) -> int:
    """Append raw text (a torn line, a garbled one); returns the bytes written."""
    with open(path, "a") as f:
        f.write(text)
    return len(text.encode())


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python make_run.py <runs_dir>")
    print(run_demo(Path(sys.argv[1])))
