"""Hugging Face integration: one adapter module per model family."""

from workbench.models import qwen3_moe

# model_type -> adapter module. Adding a family = adding one file and one entry here.
ADAPTERS = {qwen3_moe.MODEL_TYPE: qwen3_moe}


def adapter_for(config):
    """The family adapter for a Transformers config, or None for architectures without one."""
    return ADAPTERS.get(getattr(config, "model_type", None))
