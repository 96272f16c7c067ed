"""MoE Workbench: fine-tune Mixture-of-Experts LLMs from JupyterLab, headless or as a drop-in."""

from __future__ import annotations

from typing import Any

from workbench.backends import BackendConfig, BackendError
from workbench.errors import CheckpointError
from workbench.models.auto import AutoModelForCausalLM, save_pretrained
from workbench.parallel.mesh import MeshConfig, MeshError

__version__ = "0.1.0"

# Imported on first use: the trainer pulls in datasets/tokenizers, the cluster ipyparallel and
# the UI ipywidgets/plotly; `import workbench` stays light (the engine ranks never load the UI).
_LAZY = {
    "RunConfig": "workbench.config",
    "LoraConfig": "workbench.config",
    "save_lora_adapter": "workbench.models.lora_export",
    "save_vllm_adapter": "workbench.models.lora_export",
    "save_merged": "workbench.models.lora_export",
    "finetune": "workbench.train.loop",
    "Cluster": "workbench.cluster",
    "Run": "workbench.cluster",
    "RankError": "workbench.cluster",
    "Studio": "workbench.ui",
}

__all__ = ["AutoModelForCausalLM", "BackendConfig", "BackendError", "CheckpointError", "MeshConfig", "MeshError",
           "save_pretrained", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'workbench' has no attribute {name!r}")
