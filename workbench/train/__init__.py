"""The trainer: `finetune(run_config, callbacks)` plus data, metrics and checkpoints.

Imported lazily so that `workbench.train.run_dir` (read by the lab extension) stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["finetune", "Trainer"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from workbench.train import loop

        return getattr(loop, name)
    raise AttributeError(f"module 'workbench.train' has no attribute {name!r}")
