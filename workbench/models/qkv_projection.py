"""The q/k/v projections of one attention layer as one autograd node: the input's gradient summed in the GEMMs.

Autograd of three `F.linear`s on the same input computes dx = dq Wq + dk Wk + dv Wv as three GEMMs and two
elementwise adds over the [tokens, hidden] gradient (Qwen3-30B-A3B at 8192 tokens: 2 x 32 MB read twice and written
once a layer, ~0.05 ms). Here the second and third products accumulate into the first's output in cuBLAS
(addmm with beta=1), which reads it once each instead. The roundings stay autograd's: cuBLAS's bias-add epilogue
rounded the product before it added in the router's addmm on the H200 (benchmarks/pair_gemm_check.py; these
addmms were not checked apart), as autograd rounds each product and each add.
Forward and the weight gradients are Transformers' products unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Shape suffixes: N tokens (batch x sequence), D hidden, Q/K/V the projections' widths.


def fusable(*projections: nn.Module) -> bool:
    """Whether the projections are plain bias-free nn.Linears of one dtype (not LoRA-wrapped, TE or biased)."""
    return all(type(p) is nn.Linear and p.bias is None for p in projections) and (
        len({p.weight.dtype for p in projections}) == 1
    )


class _QKVProjection(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight_q, weight_k, weight_v):
        ctx.save_for_backward(x, weight_q, weight_k, weight_v)
        return F.linear(x, weight_q), F.linear(x, weight_k), F.linear(x, weight_v)

    @staticmethod
    def backward(ctx, grad_q, grad_k, grad_v):
        # autograd materializes an unused output's gradient as zeros: all three are tensors
        x, weight_q, weight_k, weight_v = ctx.saved_tensors
        x_ND = x.reshape(-1, x.shape[-1])
        g_q, g_k, g_v = (g.reshape(-1, g.shape[-1]) for g in (grad_q, grad_k, grad_v))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(g_q, weight_q).addmm_(g_k, weight_k).addmm_(g_v, weight_v).view(x.shape)
        grad_w = [torch.mm(g.t(), x_ND) if ctx.needs_input_grad[i] else None for i, g in enumerate((g_q, g_k, g_v), 1)]
        return grad_x, *grad_w


def qkv_projection(
    x: torch.Tensor, q_proj: nn.Linear, k_proj: nn.Linear, v_proj: nn.Linear
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_proj(x), k_proj(x), v_proj(x)); with gradients, the input's summed in the GEMMs (module docstring)."""
    # under autocast the projections' dtypes are autocast's (the node's backward would not follow them)
    if not torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type) or not fusable(q_proj, k_proj, v_proj):
        return q_proj(x), k_proj(x), v_proj(x)
    return _QKVProjection.apply(x, q_proj.weight, k_proj.weight, v_proj.weight)
