"""Attention with learned per-head sinks (GPT-OSS) on fused kernels, behind Transformers' AttentionInterface.

A sink is one more logit per head in the softmax denominator, with no value; attention_sinks_kernels derives
how the fused kernels' (out, lse) take it exactly, forward and backward.

Kernels (`_SinkAttention` runs each with the same math; attention_sinks_kernels holds them):
- CUDA, full causal layers of unpacked rows: torch's cuDNN attention op (`aten._scaled_dot_product_cudnn_attention`
  and its backward), GQA natively.
- CUDA, the rest: torch's flash kernel in its variable-length form (`aten._flash_attention_forward/backward`):
  causal, sliding windows natively (window_size_left = sliding_window - 1), GQA natively, and packed documents as
  separate sequences (cu_seqlens), so windows and documents cost no dense mask.
- CPU (tests, small runs): torch's CPU flash kernel with a dense additive mask, k/v expanded for GQA.
- Anything else (a padding mask, a KV cache with fewer queries than keys, attention dropout, float32 on CUDA,
  head dims flash refuses): `reference_attention` (attention_sinks_reference), Transformers' eager math with
  the same mask semantics.

Packed rows: documents start wherever position_ids do not step by 1 (the rule of Transformers'
masking_utils.find_packed_sequence_indices, which its sdpa/eager masks use for models that pass position_ids
to the mask; GPT-OSS's own model does not, so vanilla GPT-OSS eager/flex attend across documents). Here each
document attends only to itself on every path.

The kernels and the reference math live in their own modules; their names stay importable from here
(sink_attention looks `_FlashVarlen` up in this module, where tests stand a CPU kernel in for it).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from workbench.backends import BackendError
from workbench.kernels.attention_interface import use_attention_implementation
from workbench.kernels.te_attention import register_te_attention
from workbench.models.attention_sinks_kernels import (
    _CpuFlash,
    _CudnnSdpa,
    _FlashVarlen,
    _SinkAttention,
    sdpa_extra_dim,
)
from workbench.models.attention_sinks_reference import dense_mask, document_starts, reference_attention, repeat_kv

SINK_ATTENTION = "workbench_sinks"

# Which kernel `sink_attention` runs on CUDA, per layer type, from benchmarks/attention_sinks.py on the H200 (B2
# S4096, 64/8 heads of 64, bf16, fwd+bwd; 2026-12-04): full causal layers on torch's cuDNN op 3.44 ms against flash
# 4.77 (the same errors against float32); sliding-window layers on the varlen flash kernel, 1.83 ms (windows native).
# "cudnn" takes unpacked rows only: packed documents take "flash" for full layers too. "sdpa_extra_dim" (5.07 ms:
# head dim padded 64 -> 72, the sink logit rounded through bf16 twice) stays a choice for the record.
CUDA_KERNEL = {"full": "cudnn", "sliding": "flash"}
KERNELS = ("flash", "cudnn", "sdpa_extra_dim", "cpu", "reference")
# kernels for full causal attention of unpacked rows only: a sliding or packed call takes "flash" instead
FULL_ONLY = ("cudnn", "sdpa_extra_dim")
# the largest head dim "cudnn" is picked for: the sizes it was measured and tested at (GPT-OSS's 64; Qwen3's 128
# through SDPA); a larger one takes "flash", which runs up to 256
CUDNN_MAX_HEAD_DIM = 128
# The sink's elementwise work beside the CUDA kernels (scale O and lse forward, the sink's gradient backward):
# "triton" (kernels/triton_attention_sinks.py, one pass each way) or "torch" ops (~4-5 ms a step of gpt-oss-20b L8)
GLUE_CUDA = "triton"
GLUES = ("triton", "torch")


def _fallback_reason(query, key, value, attention_mask, dropout: float) -> str | None:
    """Why the fused kernels cannot take this call (None: they can)."""
    if attention_mask is not None:
        return "a padding attention mask was given"
    if query.shape[2] != key.shape[2]:
        return f"query length {query.shape[2]} != key length {key.shape[2]} (KV cache)"
    if not query.shape[-1] == key.shape[-1] == value.shape[-1]:
        return f"head dims q {query.shape[-1]}, k {key.shape[-1]}, v {value.shape[-1]} differ"
    if dropout:
        return f"attention dropout {dropout} (the fused kernels run without dropout)"
    if query.device.type == "cuda":
        if query.dtype not in (torch.float16, torch.bfloat16):
            return f"{query.dtype} on CUDA (the flash kernel takes float16/bfloat16)"
        if query.shape[-1] % 8 or query.shape[-1] > 256:
            return f"head dim {query.shape[-1]} (flash needs a multiple of 8, <= 256)"
        return None
    if query.device.type != "cpu":
        return f"device {query.device.type}"
    return None


def pick_kernel(device: torch.device, sliding_window: int | None, packed: bool, head_dim: int = 64) -> str:
    """The kernel for one call: CUDA_KERNEL on CUDA (its full-only kernels only where they apply, cuDNN up to
    CUDNN_MAX_HEAD_DIM), "cpu" on the CPU."""
    if device.type != "cuda":
        return "cpu"
    choice = CUDA_KERNEL["sliding" if sliding_window is not None else "full"]
    if choice in FULL_ONLY and (sliding_window is not None or packed):
        return "flash"
    if choice == "cudnn" and head_dim > CUDNN_MAX_HEAD_DIM:
        return "flash"
    return choice


def flash_sequences(position_ids: torch.Tensor | None, batch: int, seq: int, device) -> tuple[torch.Tensor, int]:
    """The rows' documents as the varlen kernel takes them: cu_seqlens int32 [docs + 1] and a length bound.

    Without position_ids every row is one document: built on the device, no host sync. With them the
    document count (a shape) is read once; the kernels then take `seq` as the bound on a document's
    length instead of reading the true maximum (flash only sizes its grid by it: the extra query
    blocks of shorter documents exit at once and the results are the same).
    """
    if position_ids is None:
        return torch.arange(0, batch * seq + 1, seq, dtype=torch.int32, device=device), seq
    starts = document_starts(position_ids, batch, seq, device).flatten()
    n_docs = int(starts.sum())  # the one host read: the kernels' sequence count is a shape
    first = torch.nonzero_static(starts, size=n_docs).flatten()
    return F.pad(first, (0, 1), value=batch * seq).to(torch.int32), seq


def _starts_of(cu_seqlens: torch.Tensor, batch: int, seq: int) -> torch.Tensor:
    """Bool [B, S]: True at each document's first token, from cu_seqlens (no host read)."""
    starts = torch.zeros(batch * seq, dtype=torch.bool, device=cu_seqlens.device)
    return starts.scatter_(0, cu_seqlens[:-1].long(), True).view(batch, seq)


def _check_sequences(sequences, batch: int, seq: int) -> None:
    cu, max_len = sequences
    if not (isinstance(cu, torch.Tensor) and cu.dim() == 1 and batch + 1 <= cu.numel() <= batch * seq + 1):
        raise ValueError(
            f"cu_seq_lens_q must be a 1-D tensor of documents + 1 offsets (rows start documents, so "
            f"between {batch + 1} and {batch * seq + 1} entries for {batch} rows of {seq}); got "
            f"{tuple(cu.shape) if isinstance(cu, torch.Tensor) else type(cu).__name__}"
        )
    if isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= seq:
        raise ValueError(
            f"max_length_q must be an int in [1, {seq}] (the longest document, or {seq} as a bound); got {max_len!r}"
        )


def sink_attention(
    q,
    k,
    v,
    sinks,
    scaling: float,
    sliding_window: int | None = None,
    position_ids: torch.Tensor | None = None,
    kernel: str | None = None,
    sequences: tuple[torch.Tensor, int] | None = None,
    glue: str | None = None,
) -> torch.Tensor:
    """Causal (optionally windowed, packed) attention with sinks on fused kernels: [B, H, S, D] -> [B, S, H, D].

    `sequences`: (cu_seqlens, max_len) of the rows' documents (flash_sequences), which then take the
    place of position_ids; without them they are derived from position_ids here. `glue` (one of GLUES; None:
    GLUE_CUDA on CUDA, torch elsewhere): what runs the sink's elementwise work beside the "flash" and "cudnn" kernels.
    """
    b, h, s, d = q.shape
    if sequences is None:
        sequences = flash_sequences(position_ids, b, s, q.device)
    _check_sequences(sequences, b, s)
    cu, max_len = sequences
    packed = cu.numel() - 1 != b  # each row starts a document: more documents than rows means packing
    starts = _starts_of(cu, b, s) if packed else None
    kernel = kernel or pick_kernel(q.device, sliding_window, packed, d)
    glue = glue or (GLUE_CUDA if q.device.type == "cuda" else "torch")
    if glue not in GLUES:
        raise ValueError(f"unknown sink attention glue {glue!r}; choose one of {list(GLUES)}")
    if kernel == "reference":
        return reference_attention(q, k, v, sinks, scaling, dense_mask(s, s, sliding_window, starts, None, q.device))
    if kernel in FULL_ONLY and (sliding_window is not None or packed):
        raise ValueError(f"kernel={kernel!r} runs full causal attention of unpacked rows only")
    if kernel == "cudnn":
        out = _SinkAttention.apply(q, k, v, sinks, _CudnnSdpa(scaling), glue)
        return out.transpose(1, 2).contiguous()
    if kernel == "sdpa_extra_dim":
        if q.device.type != "cuda":
            return sdpa_extra_dim(q, k, v, sinks, scaling)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # cuDNN first: the reason to pick this option over "flash" (see CUDA_KERNEL)
        order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        with sdpa_kernel(order, set_priority=True):
            return sdpa_extra_dim(q, k, v, sinks, scaling)
    if kernel == "cpu":
        allowed = dense_mask(s, s, sliding_window, starts, None, q.device)
        n_rep = h // k.shape[1]
        runner = _CpuFlash(allowed, scaling, q.dtype)
        out = _SinkAttention.apply(q, repeat_kv(k, n_rep), repeat_kv(v, n_rep), sinks, runner)
        return out.transpose(1, 2).contiguous()
    if kernel != "flash":
        raise ValueError(f"unknown sink attention kernel {kernel!r}; choose one of {list(KERNELS)}")
    if max_len < 2:  # flash lays out lse differently for single-token queries (its decode path)
        return reference_attention(q, k, v, sinks, scaling, dense_mask(s, s, sliding_window, starts, None, q.device))
    runner = _FlashVarlen(cu.to(device=q.device, dtype=torch.int32), max_len, scaling, sliding_window)
    # Transformers hands [B, H, S, D]; the varlen kernel takes [B*S, H, D] (a copy only where RoPE made q/k new)
    q_t, k_t, v_t = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (q, k, v))
    out = _SinkAttention.apply(q_t, k_t, v_t, sinks, runner, glue)
    return out.view(b, s, h, d)


def sink_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    s_aux: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers attention interface: q/k/v [B, H, S, D] in, ([B, S, H, D], None) out; sinks from s_aux."""
    if kwargs.get("softcap") is not None:
        raise ValueError("attention 'workbench_sinks' does not implement softcap; use attn_implementation='eager'")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError("attention 'workbench_sinks' is causal only; this module is not causal")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    # Transformers' packed-sequence kwargs (FlashAttentionKwargs); EngineCausalLM passes them so that the
    # documents are found once per forward, not once per layer
    sequences = None
    if kwargs.get("cu_seq_lens_q") is not None:
        sequences = (kwargs["cu_seq_lens_q"], kwargs.get("max_length_q") or query.shape[2])
    reason = _fallback_reason(query, key, value, attention_mask, dropout)
    if reason is None:
        return sink_attention(
            query, key, value, s_aux, scaling, sliding_window, position_ids, sequences=sequences
        ), None
    warnings.warn(f"attention 'workbench_sinks' runs Transformers' eager math for this call: {reason}", stacklevel=2)
    q_len, kv_len = query.shape[2], key.shape[2]
    # Transformers detects packed documents only without a padding mask and with q_len == kv_len (no cache)
    starts = None
    if attention_mask is None and q_len == kv_len:
        starts = (
            document_starts(position_ids, query.shape[0], q_len, query.device)
            if sequences is None
            else _starts_of(sequences[0], query.shape[0], q_len)
        )
    allowed = dense_mask(q_len, kv_len, sliding_window, starts, attention_mask, query.device)
    out = reference_attention(query, key, value, s_aux, scaling, allowed, dropout, module.training)
    return out, None


def runs_sink_attention(model: nn.Module) -> bool:
    """Whether `model` runs "workbench_sinks" (its documents are then found once per forward: forward_sequences)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None) == SINK_ATTENTION


def forward_sequences(model: nn.Module, args: tuple, kwargs: dict) -> dict:
    """Transformers' packed-sequence kwargs for one forward of a "workbench_sinks" model, or {} where not wanted.

    Found once per forward (flash_sequences: no host read without position_ids, one with them) and
    handed to every layer, instead of each layer finding them from position_ids, which Transformers
    fills in (an arange) when the caller gave none.
    """
    if getattr(model.config, "_attn_implementation", None) != SINK_ATTENTION or len(args) > 1:
        return {}
    if any(kwargs.get(k) is not None for k in ("cu_seq_lens_q", "attention_mask", "past_key_values")):
        return {}
    x = kwargs.get("input_ids", args[0] if args else None)
    x = kwargs.get("inputs_embeds") if x is None else x
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        return {}
    cu, max_len = flash_sequences(kwargs.get("position_ids"), x.shape[0], x.shape[1], x.device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max_len, "max_length_k": max_len}


def register_sink_attention() -> str:
    """Register "workbench_sinks" with Transformers (attention and mask interfaces); returns the name.

    The mask function is flash attention's: None, or the 2-D padding mask. Causality, windows and packed
    documents come from the call itself (sliding_window, position_ids), so no dense mask is built.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(SINK_ATTENTION, sink_attention_forward)
    AttentionMaskInterface.register(SINK_ATTENTION, flash_attention_mask)
    return SINK_ATTENTION


def has_sinks(model: nn.Module) -> bool:
    """Whether any attention module of `model` holds learned sinks (GPT-OSS's `sinks` parameter)."""
    return any(isinstance(getattr(m, "sinks", None), nn.Parameter) for m in model.modules())


def use_sink_attention(model: nn.Module) -> None:
    """Point `model` (a Transformers PreTrainedModel) at "workbench_sinks", on its own copy of the config.

    Transformers builds models around the caller's config object: switching it in place would also switch
    every other model built from that config (a reference model in a test, a benchmark's anchor).
    """
    use_attention_implementation(model, register_sink_attention())


def select_attention(model: nn.Module, attention: str, sinks_by_default: bool = False) -> str | None:
    """The generic path's attention for `model` from the resolved BackendConfig.attention; the name set, or None.

    "sinks" always runs the engine's function. A model with sinks whose family runs them by default
    (`sinks_by_default`: Family.sinks_by_default, GPT-OSS's, whose parity with Transformers' eager the tests
    check in tests/test_attention_sinks.py) gets it for "sdpa" too, the choice "auto" resolves to: Transformers'
    sdpa cannot express sinks (GPT-OSS refuses it), and this is the same fused causal attention plus the sink.
    Other families with sinks (deepseek_v4, mimo_v2_flash, granite_swa, ...) keep Transformers' attention unless
    attention='sinks' is asked for. "te" runs TransformerEngine's attention (kernels/te_attention.py) and is refused
    for a model with sinks, which it cannot run.
    """
    sinks = has_sinks(model)
    if sinks and attention == "te":
        raise BackendError(
            f"BackendConfig.attention='te' cannot run the attention sinks of model_type "
            f"{model.config.model_type!r}; use attention='auto' or 'sinks'"
        )
    if attention == "te":
        name = register_te_attention()
        use_attention_implementation(model, name)
        return name
    auto = sinks and sinks_by_default
    if attention == "sinks" or (auto and attention == "sdpa"):
        use_sink_attention(model)
        return SINK_ATTENTION
    return None
