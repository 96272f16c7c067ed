"""The sink-aware autograd function on fused kernels, its runners (CUDA varlen flash, CUDA cuDNN, CPU flash),
sdpa_extra_dim.

A sink is one more logit per head in the softmax denominator, with no value: p_j = exp(s_j) / (Z + exp(sink)),
Z = sum_j exp(s_j). With lse = log Z the sink-aware output is the plain output times
w = exp(lse - lse'), lse' = logaddexp(lse, sink), i.e. sigmoid(lse - sink). The backward needs no gradient
through lse: a flash-style backward recomputes P = exp(S - lse) and D = rowsum(dO * O) from the (O, lse) it is
given, so handing it the sink-scaled output O' = w * O and lse' yields exactly the sink softmax's dQ, dK, dV
(P' = exp(S - lse') are the sink probabilities, and D' = rowsum(dO * O') is the sink softmax's row term since
the sink's value is 0). The sink's own gradient is dsink = -sum over rows of exp(sink - lse') * D'.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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


class _CudnnSdpa:
    """torch's cuDNN attention, full causal over unpacked rows: q [B, H, S, D], k/v [B, Hkv, S, D] (GQA as given,
    any strides SDPA takes), lse [B, H, S] (torch returns it [B, H, S] or [B, H, S, 1]: kept as returned for the
    backward). The one runner whose kernel is not flash: on the H200 its full causal layers of GPT-OSS-20B's shape
    (64 heads of 64) took 3.44 ms fwd+bwd with sinks against flash's 4.77 (benchmarks/NOTES.md, 2026-12-04);
    windows and packed documents stay with _FlashVarlen."""

    lse_head_axis = 1

    def __init__(self, scaling: float):
        self.scaling = scaling

    def forward(self, q, k, v):
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, True, False, scale=self.scaling
        )
        b, h, s = q.shape[:3]
        if lse.numel() != b * h * s or tuple(out.shape) != tuple(q.shape):
            raise RuntimeError(
                f"torch's cuDNN attention returned out {tuple(out.shape)} and lse {tuple(lse.shape)} for q "
                f"{tuple(q.shape)}; the sink attention expects out shaped as q and one lse per query and head"
            )
        return out, lse.reshape(b, h, s), (tuple(lse.shape), cum_q, cum_k, max_q, max_k, seed, offset)

    def backward(self, dout, q, k, v, out, lse, state):
        lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = state
        if dout.stride() != out.stride():  # cuDNN reads dO in O's layout
            dout = torch.empty_like(out).copy_(dout)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.reshape(lse_shape), seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, True,
            scale=self.scaling,
        )  # fmt: skip
        return dq, dk, dv

    @staticmethod
    def lse_to_out(x):  # [B, H, S] -> broadcastable over [B, H, S, D]
        return x.unsqueeze(-1)


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


def _bhsd(x: torch.Tensor, head_axis: int) -> torch.Tensor:
    # a runner's out ([T, H, D] or [B, H, S, D]) or lse ([H, T] or [B, H, S]) as the [B, H, S(, D)] view the
    # Triton glue takes (no copy)
    if head_axis == 1:
        return x
    return x.transpose(0, 1).unsqueeze(0) if x.dim() == 3 else x.unsqueeze(0)


def _sink_view(sinks: torch.Tensor, lse: torch.Tensor, head_axis: int) -> torch.Tensor:
    shape = [1] * lse.dim()
    shape[head_axis] = -1
    return sinks.float().reshape(shape)


class _SinkAttention(torch.autograd.Function):
    """Fused attention (kernel given) whose softmax has one sink logit per head; exact backward (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel, glue="torch"):
        # glue: the sink's elementwise work on "triton" (kernels/triton_attention_sinks.py, one pass each way) or
        # "torch" ops
        out, lse, state = kernel.forward(q, k, v)
        if sinks is not None:
            # the kernels' backward read lse and out with their own strides: keep them
            lse_s, out_s = torch.empty_like(lse), torch.empty_like(out)
            if glue == "triton":
                # Triton: optional, imported where its kernel runs
                from workbench.kernels.triton_attention_sinks import sink_scale

                head = kernel.lse_head_axis
                sink_scale(_bhsd(out, head), _bhsd(lse, head), sinks, _bhsd(out_s, head), _bhsd(lse_s, head))
            else:
                torch.logaddexp(lse, _sink_view(sinks, lse, kernel.lse_head_axis), out=lse_s)
                torch.mul(out, kernel.lse_to_out(torch.exp(lse - lse_s)), out=out_s)
            out, lse = out_s, lse_s
        ctx.kernel, ctx.state, ctx.has_sinks, ctx.glue = kernel, state, sinks is not None, glue
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
            if ctx.glue == "triton":
                # Triton: optional, imported where its kernel runs
                from workbench.kernels.triton_attention_sinks import sink_grad

                dsinks = sink_grad(_bhsd(dout, head), _bhsd(out, head), _bhsd(lse, head), sinks).to(sinks.dtype)
            else:
                row = (dout.float() * out.float()).sum(-1)  # rowsum(dO * O') in the out layout
                row = row.transpose(0, 1) if head == 0 else row  # [T, H] -> [H, T]; [B, H, S] stays
                p_sink = torch.exp(_sink_view(sinks, lse, head) - lse)
                dims = [d for d in range(lse.dim()) if d != head]
                dsinks = (-(p_sink * row).sum(dim=dims)).to(sinks.dtype)
        return dq, dk, dv, dsinks, None, None


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
