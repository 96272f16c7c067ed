"""Attention with learned per-head sinks (GPT-OSS) on fused kernels, behind Transformers' AttentionInterface.

A sink is one more logit per head in the softmax denominator, with no value: p_j = exp(s_j) / (Z + exp(sink)),
Z = sum_j exp(s_j). With lse = log Z the sink-aware output is the plain output times
w = exp(lse - lse'), lse' = logaddexp(lse, sink), i.e. sigmoid(lse - sink). The backward needs no gradient
through lse: a flash-style backward recomputes P = exp(S - lse) and D = rowsum(dO * O) from the (O, lse) it is
given, so handing it the sink-scaled output O' = w * O and lse' yields exactly the sink softmax's dQ, dK, dV
(P' = exp(S - lse') are the sink probabilities, and D' = rowsum(dO * O') is the sink softmax's row term since
the sink's value is 0). The sink's own gradient is dsink = -sum over rows of exp(sink - lse') * D'.

Kernels (`_SinkAttention` runs either with the same math):
- CUDA: torch's flash kernel in its variable-length form (`aten._flash_attention_forward/backward`): causal,
  sliding windows natively (window_size_left = sliding_window - 1), GQA natively, and packed documents as
  separate sequences (cu_seqlens), so windows and documents cost no dense mask.
- CPU (tests, small runs): torch's CPU flash kernel with a dense additive mask, k/v expanded for GQA.
- Anything else (a padding mask, a KV cache with fewer queries than keys, attention dropout, float32 on CUDA,
  head dims flash refuses): `reference_attention`, Transformers' eager math with the same mask semantics.

Packed rows: documents start wherever position_ids do not step by 1 (the rule of Transformers'
masking_utils.find_packed_sequence_indices, which its sdpa/eager masks use for models that pass position_ids
to the mask; GPT-OSS's own model does not, so vanilla GPT-OSS eager/flex attend across documents). Here each
document attends only to itself on every path.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from workbench.kernels.attention_interface import use_attention_implementation

SINK_ATTENTION = "workbench_sinks"
# Families whose attention='auto' on the generic path is this function: those whose parity with Transformers'
# eager the tests check (tests/test_attention_sinks.py). Other families with sinks (deepseek_v4, mimo_v2_flash,
# granite_swa, ...) keep Transformers' attention unless attention='sinks' is asked for.
AUTO_FAMILIES = ("gpt_oss",)

# Which kernel `sink_attention` runs on CUDA. "flash" (torch's flash kernel, varlen form) serves both layer
# types; "sdpa_extra_dim" (full causal layers of unpacked rows only, through public SDPA with cuDNN first) is
# expected faster for full layers on Hopper (cuDNN 2.00 vs flash 3.55 ms at d128, benchmarks/NOTES.md) but costs a
# head dim padded 64 -> 72 and rounds the sink logit through bf16 twice. Both are choices to be confirmed by
# benchmarks/attention_sinks.py on the H200 (fwd+bwd time, peak memory, error vs float32); until then
# "flash" is the default for both layer types, the one whose numerics are exact by construction.
CUDA_KERNEL = {"full": "flash", "sliding": "flash"}
KERNELS = ("flash", "sdpa_extra_dim", "cpu", "reference")


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


class _FlashVarlen:
    """torch's CUDA flash kernel, variable-length form: q/k/v [T, H, D], lse [H, T]."""

    lse_head_axis = 0

    def __init__(self, cu_seqlens: torch.Tensor, max_len: int, scaling: float, sliding_window: int | None):
        self.cu, self.max_len, self.scaling = cu_seqlens, max_len, scaling
        # Transformers' window keeps keys with q - kv < sliding_window; flash's left window is inclusive
        self.left = sliding_window - 1 if sliding_window is not None else None

    def forward(self, q, k, v):
        out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q,
            k,
            v,
            self.cu,
            self.cu,
            self.max_len,
            self.max_len,
            0.0,
            True,
            False,
            scale=self.scaling,
            window_size_left=self.left,
            window_size_right=0 if self.left is not None else None,
        )
        if tuple(lse.shape) != (q.shape[1], q.shape[0]):
            raise RuntimeError(
                f"torch's varlen flash kernel returned lse of shape {tuple(lse.shape)}, expected "
                f"[heads, tokens] = {(q.shape[1], q.shape[0])} (unpadded, torch >= 2.5); the sink attention "
                "cannot read it on this torch: upgrade torch"
            )
        return out, lse, (rng, unused)

    def backward(self, dout, q, k, v, out, lse, state):
        rng, unused = state
        return torch.ops.aten._flash_attention_backward(
            dout,
            q,
            k,
            v,
            out,
            lse,
            self.cu,
            self.cu,
            self.max_len,
            self.max_len,
            0.0,
            True,
            rng,
            unused,
            scale=self.scaling,
            window_size_left=self.left,
            window_size_right=0 if self.left is not None else None,
        )

    @staticmethod
    def lse_to_out(x):  # [H, T] -> broadcastable over [T, H, D]
        return x.transpose(0, 1).unsqueeze(-1)


class _CpuFlash:
    """torch's CPU flash kernel with a dense additive mask: q/k/v [B, H, S, D] (k/v expanded), lse [B, H, S]."""

    lse_head_axis = 1

    def __init__(self, allowed: torch.Tensor, scaling: float, dtype):
        self.mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))
        self.scaling = scaling

    def forward(self, q, k, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, False, attn_mask=self.mask, scale=self.scaling
        )
        return out, lse, None

    def backward(self, dout, q, k, v, out, lse, state):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, False, attn_mask=self.mask, scale=self.scaling
        )

    @staticmethod
    def lse_to_out(x):  # [B, H, S] -> broadcastable over [B, H, S, D]
        return x.unsqueeze(-1)


def _sink_view(sinks: torch.Tensor, lse: torch.Tensor, head_axis: int) -> torch.Tensor:
    shape = [1] * lse.dim()
    shape[head_axis] = -1
    return sinks.float().reshape(shape)


class _SinkAttention(torch.autograd.Function):
    """Fused attention (kernel given) whose softmax has one sink logit per head; exact backward (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel):
        out, lse, state = kernel.forward(q, k, v)
        if sinks is not None:
            # the kernels' backward read lse and out with their own strides: keep them
            lse_s = torch.logaddexp(lse, _sink_view(sinks, lse, kernel.lse_head_axis), out=torch.empty_like(lse))
            w = kernel.lse_to_out(torch.exp(lse - lse_s))
            out = torch.mul(out, w, out=torch.empty_like(out))
            lse = lse_s
        ctx.kernel, ctx.state, ctx.has_sinks = kernel, state, sinks is not None
        ctx.save_for_backward(q, k, v, out, lse, sinks if sinks is not None else q.new_empty(0))
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        kernel = ctx.kernel
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, ctx.state)
        dsinks = None
        if ctx.has_sinks and ctx.needs_input_grad[3]:
            head = kernel.lse_head_axis
            row = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O') in the out layout
            row = row.transpose(0, 1) if head == 0 else row  # [T, H] -> [H, T]; [B, H, S] stays
            p_sink = torch.exp(_sink_view(sinks, lse, head) - lse)
            dims = [d for d in range(lse.dim()) if d != head]
            dsinks = (-(p_sink * row).sum(dim=dims)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None


def sdpa_extra_dim(q, k, v, sinks, scaling: float) -> torch.Tensor:
    """Full causal sink attention through public SDPA: the sink is one more key, reached by extra head dims.

    q' = [q, hi, lo, 0...], k' = [k, 0, 0, 0...] for real keys and k_sink = [0, 1, 1, 0...] with value 0,
    where hi + lo = sink / scaling split into two rounding steps (bf16 keeps ~16 bits of the sink). The sink
    key goes first, with a dummy zero query first too, so the causal square mask stays aligned. Head dim
    padded to a multiple of 8. q [B, H, S, D], k/v [B, Hkv, S, D]; returns [B, S, H, D].
    """
    b, h, s, d = q.shape
    hkv = k.shape[1]
    dp = -(-(d + 2) // 8) * 8
    target = sinks.float().reshape(1, h, 1, 1) / scaling
    hi = target.to(q.dtype)
    lo = (target - hi.float()).to(q.dtype)
    q_ext = torch.cat([q, hi.expand(b, h, s, 1), lo.expand(b, h, s, 1)], dim=-1)
    q_ext = F.pad(q_ext, (0, dp - d - 2, 1, 0))
    sink_key = torch.zeros(dp, dtype=k.dtype, device=k.device)
    sink_key[d : d + 2] = 1
    k_ext = torch.cat([sink_key.expand(b, hkv, 1, dp), F.pad(k, (0, dp - d))], dim=2)
    v_ext = F.pad(v, (0, dp - d, 1, 0))
    out = F.scaled_dot_product_attention(q_ext, k_ext, v_ext, is_causal=True, scale=scaling, enable_gqa=hkv != h)
    return out[:, :, 1:, :d].transpose(1, 2).contiguous()


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


def pick_kernel(device: torch.device, sliding_window: int | None, packed: bool) -> str:
    """The kernel for one call: CUDA_KERNEL on CUDA (sdpa_extra_dim only where it applies), "cpu" on the CPU."""
    if device.type != "cuda":
        return "cpu"
    choice = CUDA_KERNEL["sliding" if sliding_window is not None else "full"]
    if choice == "sdpa_extra_dim" and (sliding_window is not None or packed):
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
) -> torch.Tensor:
    """Causal (optionally windowed, packed) attention with sinks on fused kernels: [B, H, S, D] -> [B, S, H, D].

    `sequences`: (cu_seqlens, max_len) of the rows' documents (flash_sequences), which then take the
    place of position_ids; without them they are derived from position_ids here.
    """
    b, h, s, d = q.shape
    if sequences is None:
        sequences = flash_sequences(position_ids, b, s, q.device)
    _check_sequences(sequences, b, s)
    cu, max_len = sequences
    packed = cu.numel() - 1 != b  # each row starts a document: more documents than rows means packing
    starts = _starts_of(cu, b, s) if packed else None
    kernel = kernel or pick_kernel(q.device, sliding_window, packed)
    if kernel == "reference":
        return reference_attention(q, k, v, sinks, scaling, dense_mask(s, s, sliding_window, starts, None, q.device))
    if kernel == "sdpa_extra_dim":
        if sliding_window is not None or packed:
            raise ValueError("kernel='sdpa_extra_dim' runs full causal attention of unpacked rows only")
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
    out = _SinkAttention.apply(q_t, k_t, v_t, sinks, runner)
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


def select_attention(model: nn.Module, attention: str) -> str | None:
    """The generic path's attention for `model` from the resolved BackendConfig.attention; the name set, or None.

    "sinks" always runs the engine's function. An AUTO_FAMILIES model gets it for "sdpa" too, the choice
    "auto" resolves to: Transformers' sdpa cannot express sinks (GPT-OSS refuses it), and this is the same
    fused causal attention plus the sink. "te" cannot run sinks and is refused for a model with sinks.
    """
    sinks = has_sinks(model)
    if sinks and attention == "te":
        from workbench.backends import BackendError

        raise BackendError(
            f"BackendConfig.attention='te' cannot run the attention sinks of model_type "
            f"{model.config.model_type!r}; use attention='auto' or 'sinks'"
        )
    auto = sinks and getattr(model.config, "model_type", None) in AUTO_FAMILIES
    if attention == "sinks" or (auto and attention == "sdpa"):
        use_sink_attention(model)
        return SINK_ATTENTION
    return None
