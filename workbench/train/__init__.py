"""The trainer: `finetune(run_config, callbacks)` plus data, metrics and checkpoints."""

from __future__ import annotations

from workbench.train.loop import Trainer, finetune

__all__ = ["Trainer", "finetune"]
