"""Packed documents reach the engine's sequence mixers: the decoder layer hands its position ids on to the mixer.

Transformers' hybrid decoder layers (NemotronHBlock, Qwen3.5's and Qwen3-Next's decoder layers) take `position_ids`
but call their linear-attention mixer without them, and the mixers' torch paths run every row as one sequence: the
state of one packed document flows into the next. The engine's layer (a class swap of Transformers' layer, the same
parameters) adds them to the mixer's keywords as `mixer_position_ids`; the engine's mixer restarts its scan and its
convolution at each document's first token (wherever the position ids do not step by one, the rule the attention
masks use: attention_sinks_reference.document_starts).
"""

from __future__ import annotations

import torch

from workbench.models.attention_sinks_reference import document_starts
from workbench.models.host_packing import known_unpacked

# The keyword the engine's decoder layer adds for its mixer.
POSITIONS_KEY = "mixer_position_ids"


class MixerDocumentsLayer:
    """Mixin before Transformers' decoder layer class: its linear-attention mixer gets the layer's position ids."""

    def forward(self, hidden_states, *args, **kwargs):
        """Transformers' forward, with `mixer_position_ids` among the keywords it passes to a linear-attention mixer."""
        positions = kwargs.get("position_ids")
        if positions is not None and getattr(self, "block_type", None) == "linear_attention":
            kwargs[POSITIONS_KEY] = positions
        return super().forward(hidden_states, *args, **kwargs)


def mixer_document_starts(position_ids: torch.Tensor | None, batch: int, seq: int, device) -> torch.Tensor | None:
    """Bool [B, S], True at each document's first token; None where each row is known to be one document.

    Known: no position ids (Transformers counts 0 .. S-1), or the trainer's host batch said so (host_packing), which
    spares the masks' work on unpacked rows without reading the device.
    """
    if position_ids is None or known_unpacked(seq):
        return None
    if position_ids.dim() == 3:  # Qwen3.5's multimodal [4 or 3, B, S] positions: the first row is the text's
        position_ids = position_ids[0]
    return document_starts(position_ids, batch, seq, device)
