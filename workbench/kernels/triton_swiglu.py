"""Triton SwiGLU: silu(gate) * up forward and backward, each one elementwise kernel (imported lazily).

Rounding follows the eager torch ops (silu rounded to the input dtype, then the product), so
bf16 results match `F.silu(gate) * up` closely. The row-weighted form (w[m] * silu(gate) * up, the routing
weight of each expert row applied before the down projection: moe/row_weights.py) rounds the three-way product
once, and its backward sums each row's weight gradient.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# Shape suffixes: M rows, I intermediate.

BLOCK_I = 1024


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, WR, stride_g, stride_u, stride_y, I, BLOCK: tl.constexpr, HAS_WR: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g * tl.sigmoid(g)).to(Y.dtype.element_ty).to(tl.float32)
    h = silu * u
    if HAS_WR:  # the row's routing weight, in the same float32 product: one rounding
        h = h * tl.load(WR + row).to(tl.float32)
    tl.store(Y + row * stride_y + cols, h.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, stride_dy, stride_g, stride_u, stride_dg, stride_du, I, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = (g * sig).to(G.dtype.element_ty).to(tl.float32)
    d_silu = (dy * u).to(G.dtype.element_ty).to(tl.float32)
    dg = d_silu * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + row * stride_du + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_weighted_bwd_kernel(
    DY, G, U, WR, DG, DU, DWR, stride_dy, stride_g, stride_u, stride_dg, stride_du, I, BLOCK: tl.constexpr
):  # fmt: skip
    # one program a row: the weight's gradient sums over the whole row
    row = tl.program_id(0).to(tl.int64)
    w = tl.load(WR + row).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, I, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < I
        dy_w = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
        sig = tl.sigmoid(g)
        silu = (g * sig).to(G.dtype.element_ty).to(tl.float32)
        dw += dy_w * silu * u
        dy = dy_w * w
        d_silu = (dy * u).to(G.dtype.element_ty).to(tl.float32)
        dg = d_silu * sig * (1.0 + g * (1.0 - sig))
        tl.store(DG + row * stride_dg + cols, dg.to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + row * stride_du + cols, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    tl.store(DWR + row, tl.sum(dw, axis=0).to(DWR.dtype.element_ty))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """[..., I] -> [M, I] with unit stride along I (a view when possible)."""
    t_MI = t.reshape(-1, t.shape[-1])
    return t_MI if t_MI.stride(-1) == 1 else t_MI.contiguous()


def _forward(gate_MI: torch.Tensor, up_MI: torch.Tensor, weights_M: torch.Tensor | None = None) -> torch.Tensor:
    M, I = gate_MI.shape
    y_MI = torch.empty((M, I), dtype=gate_MI.dtype, device=gate_MI.device)
    if M and I:
        grid = (M, triton.cdiv(I, BLOCK_I))
        _swiglu_fwd_kernel[grid](
            gate_MI,
            up_MI,
            y_MI,
            y_MI if weights_M is None else weights_M,
            gate_MI.stride(0),
            up_MI.stride(0),
            y_MI.stride(0),
            I,
            BLOCK=BLOCK_I,
            HAS_WR=weights_M is not None,
        )
    return y_MI


def _backward(dy_MI, gate_MI, up_MI, dgate_MI, dup_MI, weights_M=None, dweights_M=None) -> None:
    """The gradients into dgate/dup; with `weights_M`, of the row-weighted form, its gradient into `dweights_M`."""
    M, I = gate_MI.shape
    if not (M and I):
        return
    strides = (dy_MI.stride(0), gate_MI.stride(0), up_MI.stride(0), dgate_MI.stride(0), dup_MI.stride(0), I)
    if weights_M is None:
        grid = (M, triton.cdiv(I, BLOCK_I))
        _swiglu_bwd_kernel[grid](dy_MI, gate_MI, up_MI, dgate_MI, dup_MI, *strides, BLOCK=BLOCK_I)
    else:
        _swiglu_weighted_bwd_kernel[(M,)](
            dy_MI, gate_MI, up_MI, weights_M, dgate_MI, dup_MI, dweights_M, *strides, BLOCK=BLOCK_I
        )


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate_MI, up_MI = _rows(gate), _rows(up)
        ctx.save_for_backward(gate_MI, up_MI)
        ctx.shape = gate.shape
        return _forward(gate_MI, up_MI).view(gate.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate_MI, up_MI = ctx.saved_tensors
        dgate_MI, dup_MI = torch.empty_like(gate_MI), torch.empty_like(up_MI)
        _backward(_rows(dy), gate_MI, up_MI, dgate_MI, dup_MI)
        return dgate_MI.view(ctx.shape), dup_MI.view(ctx.shape)


class _SwiGLUPackedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up_M2I = _rows(gate_up)
        I = gate_up.shape[-1] // 2
        ctx.save_for_backward(gate_up_M2I)
        ctx.shape = gate_up.shape
        y_MI = _forward(gate_up_M2I[:, :I], gate_up_M2I[:, I:])
        return y_MI.view(*gate_up.shape[:-1], I)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (gate_up_M2I,) = ctx.saved_tensors
        I = gate_up_M2I.shape[-1] // 2
        # one [M, 2I] gradient buffer: no cat of two halves afterwards
        dgate_up_M2I = torch.empty_like(gate_up_M2I)
        _backward(_rows(dy), gate_up_M2I[:, :I], gate_up_M2I[:, I:], dgate_up_M2I[:, :I], dgate_up_M2I[:, I:])
        return dgate_up_M2I.view(ctx.shape)


class _SwiGLUPackedWeightedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up: torch.Tensor, weights_M: torch.Tensor) -> torch.Tensor:
        gate_up_M2I = _rows(gate_up)
        I = gate_up.shape[-1] // 2
        weights_M = weights_M.contiguous()
        ctx.save_for_backward(gate_up_M2I, weights_M)
        ctx.shape = gate_up.shape
        y_MI = _forward(gate_up_M2I[:, :I], gate_up_M2I[:, I:], weights_M)
        return y_MI.view(*gate_up.shape[:-1], I)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        gate_up_M2I, weights_M = ctx.saved_tensors
        I = gate_up_M2I.shape[-1] // 2
        dgate_up_M2I = torch.empty_like(gate_up_M2I)
        # every row's program stores its weight's gradient; rows of width 0 launch none
        dweights_M = torch.empty_like(weights_M) if I else torch.zeros_like(weights_M)
        _backward(
            _rows(dy), gate_up_M2I[:, :I], gate_up_M2I[:, I:], dgate_up_M2I[:, :I], dgate_up_M2I[:, I:],
            weights_M, dweights_M,
        )  # fmt: skip
        return dgate_up_M2I.view(ctx.shape), dweights_M


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with fused Triton forward and backward."""
    check_triton_device(gate, "swiglu")
    return _SwiGLUFunction.apply(gate, up)


def swiglu_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = cat(gate, up) along the last dim, fused in Triton."""
    check_triton_device(gate_up, "swiglu")
    return _SwiGLUPackedFunction.apply(gate_up)


def swiglu_packed_weighted(gate_up: torch.Tensor, weights_M: torch.Tensor) -> torch.Tensor:
    """weights[m] * silu(gate) * up for packed rows [M, 2I] and one weight a row [M], fused in Triton."""
    check_triton_device(gate_up, "swiglu")
    return _SwiGLUPackedWeightedFunction.apply(gate_up, weights_M)
