"""MoE Workbench: fine-tune Mixture-of-Experts LLMs from JupyterLab, headless or as a drop-in."""

from workbench.backends import BackendConfig, BackendError
from workbench.models.auto import AutoModelForCausalLM, CheckpointError

__all__ = ["AutoModelForCausalLM", "BackendConfig", "BackendError", "CheckpointError"]
__version__ = "0.1.0"
