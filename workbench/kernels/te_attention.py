"""attention='te': TransformerEngine DotProductAttention behind Transformers' attention interface.

The model keeps Transformers' attention modules (q/k/v/o projections, q/k norms, RoPE); only the
core softmax(QK^T)V is TE's, registered as the attention implementation "workbench_te".

TE runs the plain causal case: no mask (Transformers passes None when every token attends to all
earlier ones), query and key of equal length. Anything else (padding masks, packed sequences
whose position_ids restart, a KV cache with fewer queries than keys, sliding windows, softcap)
falls back to Transformers' SDPA for that call, with the reason recorded on the attention module
(`workbench_attention_fallback`) and warned once: SFT batches with packed sequences are common,
and a refusal there would make attention='auto' unusable for them.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from workbench.kernels import te_common

TE_ATTENTION = "workbench_te"
# Attribute on each attention module: why its last call fell back to SDPA (None: it ran TE).
FALLBACK_ATTR = "workbench_attention_fallback"
# DotProductAttention instances live in the module's __dict__ under this name, outside the module
# tree: TE modules carry an `_extra_state` entry that would otherwise change the state dict.
_DPA_ATTR = "_workbench_te_dpa"


def _fallback_reason(
    module: nn.Module, query: torch.Tensor, key: torch.Tensor, attention_mask, kwargs: dict
) -> str | None:
    """Why TE's causal attention cannot take this call, or None when it can."""
    if not te_common.on_te_device(query):
        return f"query is on {query.device}, TransformerEngine needs CUDA tensors"
    if attention_mask is not None:
        return (
            "an attention mask was given (padding, or packed sequences whose position_ids restart); "
            "the TE path runs the plain causal case only"
        )
    if query.shape[2] != key.shape[2]:
        return f"query length {query.shape[2]} != key length {key.shape[2]} (KV cache); TE path is causal top-left"
    if kwargs.get("sliding_window") is not None:
        return "sliding-window attention is not wired to TE"
    if kwargs.get("softcap") is not None:
        return "softcap is not wired to TE"
    if not kwargs.get("is_causal", getattr(module, "is_causal", True)):
        return "non-causal attention is not wired to TE"
    return None


def _dot_product_attention(
    module: nn.Module,
    num_heads: int,
    num_kv_heads: int,
    head_dim_qk: int,
    head_dim_v: int,
    scaling: float | None,
    dropout: float,
):
    """This module's te.DotProductAttention for these settings (built on first use, then reused)."""
    cache = module.__dict__.setdefault(_DPA_ATTR, {})
    key = (num_heads, num_kv_heads, head_dim_qk, head_dim_v, scaling, dropout)
    dpa = cache.get(key)
    if dpa is None:
        te = te_common.import_te("attention")
        kv_channels = head_dim_qk if head_dim_qk == head_dim_v else (head_dim_qk, head_dim_v)
        # layer_number stays None: TE uses it only for NVTE_APPLY_QK_LAYER_SCALING (fp16 rescaling).
        dpa = te.DotProductAttention(
            num_heads,
            kv_channels,
            num_gqa_groups=num_kv_heads,
            attention_dropout=dropout,
            qkv_format="bshd",
            attn_mask_type="causal",
            softmax_scale=scaling,
        )
        cache[key] = dpa
    return dpa


def te_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers attention interface: q/k/v [B, H, S, D] in, ([B, S, H, D], None) out."""
    reason = _fallback_reason(module, query, key, attention_mask, kwargs)
    module.__dict__[FALLBACK_ATTR] = reason
    if reason is not None:
        warnings.warn(f"attention='te' fell back to SDPA: {reason}", stacklevel=2)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        return ALL_ATTENTION_FUNCTIONS["sdpa"](
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    batch, num_heads, seq, head_dim = query.shape
    dpa = _dot_product_attention(module, num_heads, key.shape[1], head_dim, value.shape[-1], scaling, float(dropout))
    # Transformers hands [B, H, S, D] views of [B, S, H, D] projections: transposing back is
    # free, and contiguous() copies only if a caller passed something else.
    q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
    out = dpa(q, k, v, qkv_format="bshd", attn_mask_type="causal")  # [B, S, H * Dv]
    return out.view(batch, seq, num_heads, value.shape[-1]), None


def register_te_attention() -> str:
    """Register "workbench_te" with Transformers (attention and mask interfaces); returns the name.

    The mask function is SDPA's, so Transformers keeps building real masks for padding and packed
    sequences (and None for the plain causal case); an unregistered name would get None always,
    silently dropping padding masks.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(TE_ATTENTION, te_attention_forward)
    AttentionMaskInterface.register(TE_ATTENTION, sdpa_mask)
    return TE_ATTENTION
