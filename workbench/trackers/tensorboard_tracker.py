"""TensorBoard: event files in <run>/tensorboard, written by torch's SummaryWriter (tensorboard's own format)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch.utils.tensorboard import SummaryWriter

FOLDER = "tensorboard"


class TensorBoardTracker:
    def __init__(self, writer: SummaryWriter) -> None:
        self.writer = writer

    def log(self, scalars: dict[str, float], step: int) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, step)

    def close(self, state: str) -> None:
        self.writer.add_text("run/state", state)
        self.writer.close()  # flushes


def open_run(run_dir: Path, run_name: str, config: dict[str, Any]) -> TensorBoardTracker:
    writer = SummaryWriter(log_dir=str(Path(run_dir) / FOLDER))
    writer.add_text("run/name", run_name)
    # a code block: TensorBoard renders text as Markdown
    writer.add_text("run/config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```")
    return TensorBoardTracker(writer)
