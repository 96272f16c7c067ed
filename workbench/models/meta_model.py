"""Transformers' own causal LM for a config, on the meta device: what the checks read (fused experts, LoRA targets,
checkpoint headers) and the class a save writes through, without memory or init."""

from __future__ import annotations

import torch
import transformers
from torch import nn


def meta_model(config) -> nn.Module:
    """Transformers' causal LM for `config` on the meta device (no memory, no init)."""
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)
