"""The short causal depthwise convolution of the hybrid models' sequence mixers (Mamba2, Gated DeltaNet).

Written as K shifted multiply-adds in float32 instead of `F.conv1d(groups=channels)`: under torch.compile the taps,
the bias and the activation fuse into one elementwise kernel, and packed documents are kept apart by masking every
tap that reaches back across a document's first token (the document starts afresh, as if it were alone in its row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Shape suffixes: B batch, S sequence, C channels, K taps.


def document_index(starts_BS: torch.Tensor) -> torch.Tensor:
    """Int [B, S]: each token's document within its row (0, 1, ...), from the bool first-token marks."""
    return starts_BS.to(torch.int32).cumsum(-1)


def causal_depthwise_conv(
    x_BSC: torch.Tensor,
    weight_CK: torch.Tensor,
    bias_C: torch.Tensor | None,
    starts_BS: torch.Tensor | None = None,
    silu: bool = True,
) -> torch.Tensor:
    """out[t] = bias + sum_j weight[:, j] * x[t - (K - 1) + j], then SiLU; float32 [B, S, C].

    Matches `F.conv1d(x.transpose(1, 2), weight[:, None], bias, padding=K - 1, groups=C)[..., :S]` (Transformers'
    causal_conv1d_fn). `starts_BS` (bool, True at each document's first token): a tap reaching a token before the
    current document's first is zero, as the left padding is for a row's first document.
    """
    _, seq, _ = x_BSC.shape
    taps = weight_CK.shape[-1]
    x = x_BSC.float()
    w = weight_CK.float()
    out = x * w[:, taps - 1]
    # keep_BS: the token `shift` places back is in the current document (no first token in between)
    keep_BS = None if starts_BS is None else ~starts_BS
    for shift in range(1, taps):
        if shift >= seq:
            break
        back = F.pad(x[:, : seq - shift], (0, 0, shift, 0))
        if keep_BS is not None:
            back = back * keep_BS[..., None]
            if shift + 1 < taps:  # one more step back also crosses the first token of the token just reached
                keep_BS = keep_BS & F.pad(~starts_BS[:, : seq - shift], (shift, 0), value=False)
        out = out + back * w[:, taps - 1 - shift]
    if bias_C is not None:
        out = out + bias_C.float()
    return F.silu(out) if silu else out
