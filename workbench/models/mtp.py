"""Multi-token prediction (MTP) layers: which a model declares, which Transformers builds, and train.mtp_loss_weight.

DeepSeek-V3's MTP (Megatron's and NeMo's too): depth k joins the hidden state at position i with the embedding of
token i + k, runs one more decoder block and predicts token i + k + 1 through the shared lm_head; training adds
weight x the mean over depths of those cross-entropies to the next-token loss. Nemotron 3 Super and Ultra have such
layers (NemotronHConfig's num_nextn_predict_layers and mtp_layers_block_type).

Transformers (5.25) builds them inside no causal LM: Nemotron-H's config reads those fields and its model skips the
checkpoints' `mtp.*` weights on load (`_keys_to_ignore_on_load_unexpected`); DeepSeek-V3-like families skip their
trailing MTP layers the same way; Transformers' MtpModel (modeling_layers) is a separate drafting model for assisted
generation, outside the model a run trains. With no MTP head in the model there is no MTP loss to add, so
train.mtp_loss_weight > 0 is refused before any weights, naming why.
"""

from __future__ import annotations

from typing import Any

import transformers
from torch import nn

from workbench.config_checks import ConfigError

# The config fields that count a model's MTP layers, by family (DeepSeek-V3 and Nemotron-H, the generic MtpModel's,
# Qwen3.5's and Qwen3-Next's).
MTP_COUNT_FIELDS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")
# What an MTP module of a built model is called: its class (MtpLayer, ...MultiTokenPrediction...) or its name (mtp).
MTP_CLASS_MARKS = ("mtp", "multitokenprediction", "nextn")


def declared_mtp_layers(config: Any) -> tuple[str, int]:
    """(the config field, how many MTP layers it declares); ("", 0) where the config has none of the fields."""
    for field in MTP_COUNT_FIELDS:
        count = getattr(config, field, None)
        if isinstance(count, int) and count > 0:
            return field, count
    return "", 0


def built_mtp_modules(model: nn.Module) -> list[str]:
    """The names of the MTP modules `model` (a meta model is enough) holds: outermost only."""
    found: list[str] = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        cls = type(module).__name__.lower()
        if name and (leaf == "mtp" or any(mark in cls for mark in MTP_CLASS_MARKS)):
            if not any(name.startswith(outer + ".") for outer in found):
                found.append(name)
    return found


def check_mtp_loss(model: nn.Module, weight: float) -> None:
    """Refuse train.mtp_loss_weight = `weight` (> 0) for `model` (Transformers' causal LM, on the meta device): the
    trainer has no MTP head to take a loss from; the message says why for this model."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    field, declared = declared_mtp_layers(config)
    built = built_mtp_modules(model)
    if built:
        why = (
            f"transformers {transformers.__version__} builds multi-token prediction modules in model_type "
            f"{model_type!r} ({', '.join(built[:3])}), and the trainer computes no loss from them yet"
        )
    elif declared:
        why = (
            f"model_type {model_type!r} declares {declared} multi-token prediction layer{'s' * (declared != 1)} "
            f"({field}={declared}), but transformers {transformers.__version__}'s {type(model).__name__} builds "
            "none of them (a checkpoint's MTP weights are skipped on load), so there is no MTP head to train"
        )
    else:
        why = f"model_type {model_type!r} has no multi-token prediction layers ({' / '.join(MTP_COUNT_FIELDS)}: none)"
    raise ConfigError(
        f"train.mtp_loss_weight={weight} needs a model with MTP layers: {why}; set train.mtp_loss_weight to 0"
    )
