"""A run directory for the lab tests: `make_run_dir(tmp_path)`, or `python make_run.py <runs_dir>`.

Until the trainer's `workbench demo` lands this writes the run through RunDir's writer API (the same
calls the trainer makes); swap the body for a real `workbench demo --steps 2` run then.
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

from workbench.train.run_dir import RunDir


def make_run_dir(tmp_path: Path, steps: int = 6, world_size: int = 2) -> tuple[Path, str]:
    """Write one completed run under tmp_path/runs; return (runs_dir, run_id)."""
    return write_run(Path(tmp_path) / "runs", steps, world_size)


def write_run(runs_dir: Path, steps: int = 6, world_size: int = 2) -> tuple[Path, str]:
    """Write one completed run into runs_dir; return (runs_dir, run_id)."""
    config = {
        "model": {"preset": "tiny", "layers": None, "path": None},
        "mesh": {"dp": world_size, "ep": world_size},
        "backend": {"experts": "auto", "dispatcher": "auto", "gate": "native"},
        "resolved_backend": {"experts": "grouped_mm", "dispatcher": "alltoall", "gate": "native",
                             "attention": "sdpa", "rms_norm": "torch", "linear": "torch",
                             "fused_ce": False},
        "world_size": world_size,
        "train": {"steps": steps},
    }
    run = RunDir.create(runs_dir, None, config)
    run.write_status("running", step=0, total_steps=steps)
    rng = random.Random()
    for step in range(1, steps + 1):
        loss = 10.0 * math.exp(-0.2 * step) + rng.uniform(0, 0.1)
        run.append_metrics([
            {"step": step, "rank": rank, "loss": loss, "grad_norm": rng.uniform(0.5, 2),
             "lr": 1e-4, "tokens_per_s_per_gpu": rng.uniform(900, 1100) + 50 * step,
             "tflops_per_gpu": rng.uniform(1, 2), "mem_peak_gib": 0.1, "mem_now_gib": 0.05,
             "expert_load": [[rng.randint(0, 9) for _ in range(4)]], "expert_load_cv": 0.3,
             "step_time_s": 0.1, "forward_s": 0.03, "backward_s": 0.05, "optimizer_s": 0.02,
             "time": time.time()}
            for rank in range(world_size)
        ])
        run.write_status("running", step=step, total_steps=steps)
    run.write_status("completed", step=steps, total_steps=steps)
    return runs_dir, run.run_id


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python make_run.py <runs_dir>")
    print(write_run(Path(sys.argv[1]))[1])
