"""Training FLOPs per token of a Transformers config, NeMo AutoModel's formula (pure functions, no model is built).

The trainer's TFLOP/s figure (workbench.train.metrics), the bench's floor and the run plan (workbench.plan) count
with it.
"""

from __future__ import annotations

from typing import Any

from workbench.mixer_counts import mixer_counts
from workbench.params import attention_layer_flags, head_dims, layer_blocks, param_counts, sliding_layer_flags


def attention_keys_per_query(seq_len: int, window: int | None = None) -> float:
    """Mean keys per query under a causal mask (window W: a query sees itself and W - 1 before it).

    Counted as NeMo does: the (query, key) pairs of the mask less half its diagonal, over S; S/2
    for the full causal mask, W - W(W-1)/(2S) - 1/2 for a sliding window W < S.
    """
    if window is None or window >= seq_len:
        return seq_len / 2
    pairs = seq_len * window - window * (window - 1) / 2
    return (pairs - seq_len / 2) / seq_len


def flops_per_token(cfg: Any, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, NeMo AutoModel's formula for any family.

        per token = 6 * active matmul parameters                       # workbench.params
                    + sum over attention layers of 6 * n_h * (d_qk + d_v) * keys(layer)
                    + sum over a hybrid's other mixer layers of their scan / conv / recurrence FLOPs

    The first term is 2 FLOPs per multiply-add x 3 (forward, input grad, weight grad) for every
    weight matrix a token goes through: attention projections (MLA's q/kv low-rank and up
    projections included), the dense or shared MLPs, the top-k routed experts and the LM head;
    not the embedding lookup, norms, biases, the router gate or softmax (as in NeMo). The second
    is QK^T (width d_qk) and AV (width d_v) against `keys` keys per query: S/2 under the causal
    mask, less on GPT-OSS's sliding-window layers (attention_keys_per_query). With n_h heads of
    width d this is NeMo's qwen3_flops, 6 * L * H^2 * r * [(2 n_kv / n_h + 1) + S / H + 1] plus
    6 * H * (3 I_e k) per layer and 6 * H * V: 23.0 GFLOP/token for Qwen3-30B-A3B at S = 4096.
    A hybrid's Mamba2 and Gated DeltaNet layers add their projections to the first term and the terms NeMo
    AutoModel gives them to the third (workbench/mixer_counts.py: Mamba2's scan 21 d N, Gated DeltaNet's conv and
    delta rule); only its attention layers have the second.
    """
    counts = param_counts(cfg)
    attention = sum(flops for flops, _ in attention_layer_flops(cfg, seq_len))
    mixers = sum(
        mixer_counts(cfg, b.mixer).flops_per_token for b in layer_blocks(cfg) if b.mixer not in ("attention", None)
    )
    return 6 * counts.active_matmul + attention + mixers


def attention_layer_flops(cfg: Any, seq_len: int) -> list[tuple[float, float]]:
    """(training FLOPs per token, keys per query) of each attention layer: flops_per_token's second term, per layer
    (the run plan times each at the attention throughput of its span of keys)."""
    qk, v = head_dims(cfg)
    window = getattr(cfg, "sliding_window", None)
    out = []
    for sliding, attention in zip(sliding_layer_flags(cfg), attention_layer_flags(cfg)):
        if attention:
            keys = attention_keys_per_query(seq_len, window if sliding else None)
            out.append((6 * cfg.num_attention_heads * (qk + v) * keys, keys))
    return out
