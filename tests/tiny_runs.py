"""Tiny trained runs for the tests that ask a run's model: 3 steps of the demo, an hf/ export, a step-3 checkpoint."""

from __future__ import annotations

from pathlib import Path

from workbench.config import RunConfig
from workbench.train.loop import finetune


def train_tiny_run(runs_dir: Path, run_id: str, lora: bool = False) -> Path:
    """The folder of a finished 3-step run of the tiny demo model (rank-4 LoRA adapters if `lora`)."""
    rc = RunConfig.demo(
        output_dir=str(runs_dir),
        run_id=run_id,
        data__seq_len=64,
        train__steps=3,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
        train__lr=1e-2,
        train__export_hf=True,  # and, by default, a final step-* checkpoint
    )
    if lora:
        rc = rc.with_overrides({"lora.rank": 4})
    return Path(finetune(rc)["run_dir"])
