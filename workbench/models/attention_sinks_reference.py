"""Eager reference math of sink attention and the bool masks (causal, window, documents, padding) it builds on."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * n_rep, S, D], each kv head repeated for its query heads."""
    if n_rep == 1:
        return x
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


def document_starts(position_ids: torch.Tensor | None, batch: int, seq: int, device) -> torch.Tensor:
    """Bool [B, S]: True at the first token of each document (row starts, and where position_ids jump)."""
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if position_ids is not None:
        if position_ids.shape[-1] != seq:
            raise ValueError(
                f"position_ids has {position_ids.shape[-1]} positions per row but the attention "
                f"has {seq} queries; pass position_ids of the input's length"
            )
        pos = position_ids.to(device).expand(batch, seq)
        starts[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    return starts


def dense_mask(
    q_len: int,
    kv_len: int,
    sliding_window: int | None,
    starts: torch.Tensor | None,
    padding: torch.Tensor | None,
    device,
) -> torch.Tensor:
    """Bool [B or 1, 1, q_len, kv_len]: causal (queries are the last q_len positions), window, document, padding."""
    q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
    kv_pos = torch.arange(kv_len, device=device)[None, :]
    allowed = kv_pos <= q_pos
    if sliding_window is not None:
        allowed = allowed & (q_pos - kv_pos < sliding_window)
    allowed = allowed[None, None]
    if starts is not None:
        doc = starts.cumsum(-1)
        allowed = allowed & (doc[:, None, :, None] == doc[:, None, None, :])
    if padding is not None:
        allowed = allowed & padding[:, None, None, -kv_len:].to(torch.bool)
    return allowed


def reference_attention(
    q, k, v, sinks, scaling: float, allowed: torch.Tensor, dropout: float = 0.0, training: bool = False
) -> torch.Tensor:
    """Transformers' eager GPT-OSS math on [B, H, S, D] tensors and a bool mask; returns [B, S, H, D]."""
    n_rep = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(2, 3)) * scaling
    # eager adds finfo.min, not -inf: a fully masked (padding) row stays finite
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 1)
        scores = torch.cat([scores, sink], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = F.softmax(scores, dim=-1, dtype=scores.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs, p=dropout, training=training).to(v.dtype)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()
