"""MoE Workbench: fine-tune Mixture-of-Experts LLMs from JupyterLab, headless or as a drop-in."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# CUDA's caching allocator with expandable segments, unless the user configured it. The engine's steps take and free
# tensors whose sizes change with the routing; with fixed segments a run near the card's memory fragments it, and the
# allocator's free-and-retry stalls steps: the 48-layer LoRA planned to fit an 80 GB H100 (72.4 GiB peak) fell from
# 9.6k to 6.5k tokens/s within 30 steps (2026-12-06). Set here, before torch's allocator starts, so every entry point
# (CLI, notebook, the drop-in, cluster ranks) gets it; PYTORCH_ALLOC_CONF=expandable_segments:False turns it off.
if "PYTORCH_ALLOC_CONF" not in os.environ and "PYTORCH_CUDA_ALLOC_CONF" not in os.environ:
    os.environ["PYTORCH_ALLOC_CONF"] = "expandable_segments:True"

__version__ = "0.1.0"

# Imported on first use: torch and Transformers take seconds to import, the trainer pulls in
# datasets/tokenizers, the cluster ipyparallel and the UI ipywidgets/plotly; `import workbench`
# (and so every `workbench` command, `--help` included) stays light until a name is used.
_LAZY = {
    "BackendConfig": "workbench.backends",
    "BackendError": "workbench.errors",
    "AutoModelForCausalLM": "workbench.models.auto",
    "CheckpointError": "workbench.errors",
    "save_pretrained": "workbench.models.auto",
    "MeshConfig": "workbench.parallel.mesh",
    "MeshError": "workbench.parallel.mesh",
    "RunConfig": "workbench.config",
    "LoraConfig": "workbench.config",
    "save_lora_adapter": "workbench.models.lora_export",
    "save_vllm_adapter": "workbench.models.lora_export",
    "save_merged": "workbench.models.lora_export",
    "finetune": "workbench.train.loop",
    "generate": "workbench.generation.api",
    "generate_stream": "workbench.generation.api",
    "Cluster": "workbench.cluster",
    "Run": "workbench.cluster",
    "RankError": "workbench.cluster",
    "Studio": "workbench.ui",
}

__all__ = list(_LAZY)

if TYPE_CHECKING:  # what the names are, for type checkers and editors
    from workbench.backends import BackendConfig  # noqa: F401
    from workbench.errors import (
        BackendError,  # noqa: F401
        CheckpointError,  # noqa: F401
    )
    from workbench.models.auto import AutoModelForCausalLM, save_pretrained  # noqa: F401
    from workbench.parallel.mesh import MeshConfig, MeshError  # noqa: F401


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
