"""Activation checkpointing per decoder layer, for every model the trainer builds (engine, generic, vanilla).

Why torch's composable `checkpoint(module)` rather than Transformers' `gradient_checkpointing_enable`:
- It does what it says under FSDP2 and EP. Transformers 5.24's call, made after fully_shard as the
  trainer did, left Mixtral's layers unrecomputed on a DP2 x EP2 mesh (no replay in backward:
  tests/test_generic_features.py counts them; DeepSeek-V3's were replayed), where the checkpoint
  sits (`forward` or `__call__`) differs between Transformers versions, and 5.24 deprecates the call.
  torch's API is one behaviour on 5.17 and 5.24 alike.
- It registers hooks and leaves the module tree alone: parameter names stay Transformers' (a
  `checkpoint_wrapper` module would insert `_checkpoint_wrapped_module.` into every name that the
  generic path's expert gather, grad-norm tags and checkpoints read). FSDP2 registers its
  pre-forward hook first and its post-forward hook last, so its unshard/reshard stay outside the
  recomputed region whether the checkpoint is applied before or after fully_shard; FSDP2's pre-
  forward skips the unshard during recompute (its pre-backward hook did it).
- `early_stop=False`: the backward replays the WHOLE layer forward, so every collective inside it
  (the expert-parallel all-to-alls of dispatch and combine) runs again, in the same order, on
  every rank, instead of stopping wherever this rank's last saved tensor happens to be. (A torch
  without the option stops after the layer's last saved tensor; on the generic path that is past
  the combine's all-to-all, whose weighted sum saves the expert rows, so both still replay.)
- The replay runs inside the SDPA kernel preference the engine's forward sets (models/generic_extras
  attention_backend: cuDNN first on CUDA). The backward is outside that forward's `with`, so
  without it the replay picked flash attention, whose saved tensors (logsumexp [B,H,S] and a philox
  state) differ from cuDNN's ([B,H,S,1]): torch's checkpoint stopped with "Recomputed values ...
  have different metadata" (Qwen3-30B-A3B on an H200).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from workbench.models.engine_state import engine_state
from workbench.models.generic_extras import attention_backend
from workbench.parallel.fsdp import decoder_layers


def _has_early_stop() -> bool:
    """Whether this torch's composable checkpoint takes `early_stop` (probed on a throwaway module)."""
    from torch.distributed._composable import checkpoint

    try:
        checkpoint(nn.Identity(), early_stop=False)
    except ValueError:  # "Unexpected keyword arguments: early_stop"
        return False
    return True


def replay_contexts(model: nn.Module):
    """torch checkpoint's `context_fn`: nothing around the forward, the forward's attention choice around the replay."""
    backend = engine_state(model).backend
    param = next(model.parameters(), None)
    device = param.device if param is not None else torch.device("cpu")
    return lambda: (contextlib.nullcontext(), attention_backend(backend, device))


def apply_activation_checkpointing(model: nn.Module, layers: int | None = None) -> int:
    """Recompute the first `layers` decoder layers' activations in backward (None: every layer); returns how many.
    Idempotent. Which layers does not change the memory (every layer's activations live until its backward); the
    first ones, so the recompute is the same on every rank of a mesh."""
    from torch.distributed._composable import checkpoint

    kwargs = {"early_stop": False} if _has_early_stop() else {}  # older torch: see the module docstring
    kwargs["context_fn"] = replay_contexts(model)
    count = layers
    layers = decoder_layers(model)  # also after fully_shard swapped their class
    if count is not None:
        if count > len(layers):
            raise ValueError(
                f"train.activation_checkpointing_layers={count} exceeds the model's {len(layers)} decoder layers: "
                f"set it to at most {len(layers)}, or to null (every layer)"
            )
        layers = layers[:count]
    if not layers:
        raise ValueError(
            f"train.activation_checkpointing: {type(model).__name__} names no decoder layer class "
            "in _no_split_modules, so there is no layer to checkpoint; set it to false"
        )
    for layer in layers:
        if checkpoint.state(layer) is not None:  # torch's own record of the layers it wraps: once each
            continue
        checkpoint(layer, **kwargs)
    # A KV cache filled in forward would be filled again by the replay (DeepSeek-V3's MLA then saw 2S keys):
    # Transformers' own checkpointing turns the cache off too.
    model.config.use_cache = False
    return len(layers)
