"""Triton per-head RMSNorm followed by RoPE in one pass each way (Qwen3's q_norm/k_norm then RoPE; imported lazily).

Qwen3 normalizes q and k per head ([B, S, H, 128] over the head dim) and then rotates them. As two kernels
(triton_rms_norm, triton_rope) each direction reads and writes q twice: ~290 MB a layer at Qwen3-30B-A3B's 8192
tokens. Here one program per (batch, position) normalizes all its heads and rotates them before the one store, and
the backward un-rotates the gradient and runs the norm's backward in registers. Numerics are the two kernels': the
norm's output rounded to x's dtype before the rotation (as Transformers' q_norm hands RoPE a bf16 tensor), and the
un-rotated gradient rounded to it before the norm's backward; the row statistics may differ from
triton_rms_norm's in the last float32 bit (another reduction order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device, num_programs_for
from workbench.kernels.triton_rms_norm import sum_partials
from workbench.kernels.triton_rope import supported as rope_supported

# Shape suffixes: B batch, H heads, S sequence, D head dim.


@triton.jit
def _angles(COS, SIN, c_base, cols, HALF: tl.constexpr, COS_HALF_WIDTH: tl.constexpr):
    # full-width cos/sin of the columns (half-width tables stand for cat(c, c) and cat(s, s))
    idx = cols % HALF if COS_HALF_WIDTH else cols
    return tl.load(COS + c_base + idx).to(tl.float32), tl.load(SIN + c_base + idx).to(tl.float32)


@triton.jit
def _norm_rope_fwd_kernel(
    X, W, COS, SIN, OUT, RSTD, S, H, sx_b, sx_h, sx_s, so_b, so_h, so_s, sc_b, sc_s, eps,
    HALF: tl.constexpr, H_P2: tl.constexpr, COS_HALF_WIDTH: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)  # one (batch, position): every head shares its cos/sin
    b = pid // S
    s = pid % S
    heads = tl.arange(0, H_P2)
    cols = tl.arange(0, 2 * HALF)
    partner = (cols + HALF) % (2 * HALF)  # rotate_half's other column
    hmask = heads[:, None] < H
    x_rows = X + b * sx_b + s * sx_s + heads[:, None] * sx_h
    x = tl.load(x_rows + cols[None, :], mask=hmask, other=0.0).to(tl.float32)
    x_p = tl.load(x_rows + partner[None, :], mask=hmask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / (2 * HALF) + eps)
    tl.store(RSTD + pid * H + heads, rstd, mask=heads < H)
    w = tl.load(W + cols).to(tl.float32)
    w_p = tl.load(W + partner).to(tl.float32)
    # the norm's output as its own kernel stores it: x_hat in x's dtype, times the weight, in x's dtype
    n = (w[None, :] * (x * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)).to(X.dtype.element_ty)
    n_p = (w_p[None, :] * (x_p * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)).to(X.dtype.element_ty)
    c_base = b * sc_b + s * sc_s
    cos, sin = _angles(COS, SIN, c_base, cols, HALF, COS_HALF_WIDTH)
    sign = tl.where(cols < HALF, -1.0, 1.0)
    y = n.to(tl.float32) * cos[None, :] + sign[None, :] * n_p.to(tl.float32) * sin[None, :]
    tl.store(OUT + b * so_b + s * so_s + heads[:, None] * so_h + cols[None, :], y.to(OUT.dtype.element_ty), mask=hmask)


@triton.jit
def _norm_rope_bwd_kernel(
    DY, X, W, COS, SIN, RSTD, DX, DW_PARTIAL, S, H, n_pos, pos_per_program, sd_b, sd_h, sd_s, sx_b, sx_h, sx_s,
    sdx_b, sdx_h, sdx_s, sc_b, sc_s,
    HALF: tl.constexpr, H_P2: tl.constexpr, COS_HALF_WIDTH: tl.constexpr, WANT_DW: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    heads = tl.arange(0, H_P2)
    cols = tl.arange(0, 2 * HALF)
    partner = (cols + HALF) % (2 * HALF)
    hmask = heads[:, None] < H
    w = tl.load(W + cols).to(tl.float32)
    # the transpose of the rotation: dn[j] = dy[j] cos[j] + sign[j] dy[j'] sin[j'] with j' = rotate_half's partner
    sign = tl.where(cols < HALF, 1.0, -1.0)
    dw_acc = tl.zeros([H_P2, 2 * HALF], dtype=tl.float32)
    first = pid.to(tl.int64) * pos_per_program
    for i in range(pos_per_program):
        pos = first + i
        valid = pos < n_pos
        # a position past the end reads the last one's angles (its cos/sin rows exist) and stores nothing
        b = tl.minimum(pos, n_pos - 1) // S
        s = tl.minimum(pos, n_pos - 1) % S
        # (wheres, not `&`: Triton's interpreter refuses a scalar and a tensor mask)
        mask = tl.where(valid, hmask, False)
        c_base = b * sc_b + s * sc_s
        cos, _ = _angles(COS, SIN, c_base, cols, HALF, COS_HALF_WIDTH)
        _, sin_p = _angles(COS, SIN, c_base, partner, HALF, COS_HALF_WIDTH)
        dy_rows = DY + b * sd_b + s * sd_s + heads[:, None] * sd_h
        dy = tl.load(dy_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy_p = tl.load(dy_rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        # the un-rotated gradient as the RoPE kernel's backward stores it, in x's dtype
        dn = (dy * cos[None, :] + sign[None, :] * dy_p * sin_p[None, :]).to(X.dtype.element_ty).to(tl.float32)
        x = tl.load(X + b * sx_b + s * sx_s + heads[:, None] * sx_h + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        rstd = tl.load(RSTD + pos * H + heads, mask=tl.where(valid, heads < H, False), other=0.0)
        x_hat = x * rstd[:, None]
        if WANT_DW:
            dw_acc += dn * x_hat.to(X.dtype.element_ty).to(tl.float32)
        g = (dn * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / (2 * HALF))[:, None])
        tl.store(
            DX + b * sdx_b + s * sdx_s + heads[:, None] * sdx_h + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask
        )
    if WANT_DW:
        tl.store(DW_PARTIAL + pid * (2 * HALF) + cols, tl.sum(dw_acc, axis=0))


def supported(x_BHSD: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor) -> bool:
    """Where the fused kernel applies: the RoPE kernel's layouts, a weight of x's dtype over its head dim."""
    return rope_supported(x_BHSD, cos) and weight.shape == (x_BHSD.shape[-1],) and weight.dtype == x_BHSD.dtype


def _angle_strides(cos: torch.Tensor) -> tuple[int, int]:
    return (0 if cos.shape[0] == 1 else cos.stride(0)), cos.stride(1)


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, cos, sin):
        B, H, S, D = x.shape
        out = torch.empty_like(x)  # keeps x's layout ([B, S, H, D] memory seen as [B, H, S, D])
        if out.stride(-1) != 1:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(B * S * H, dtype=torch.float32, device=x.device)
        weight = weight.contiguous()
        sc_b, sc_s = _angle_strides(cos)
        if B * S:
            _norm_rope_fwd_kernel[(B * S,)](
                x, weight, cos, sin, out, rstd, S, H, x.stride(0), x.stride(1), x.stride(2), out.stride(0),
                out.stride(1), out.stride(2), sc_b, sc_s, eps,
                HALF=D // 2, H_P2=max(2, triton.next_power_of_2(H)), COS_HALF_WIDTH=cos.shape[-1] != D, num_warps=4,
            )  # fmt: skip
        ctx.save_for_backward(x, weight, cos, sin, rstd)
        return out

    @staticmethod
    def backward(ctx, dy):
        x, weight, cos, sin, rstd = ctx.saved_tensors
        B, H, S, D = x.shape
        dy = dy if dy.stride(-1) == 1 else dy.contiguous()
        dx = torch.empty_like(x)
        if dx.stride(-1) != 1:
            dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        n_pos = B * S
        programs = max(num_programs_for(x.device, n_pos), 1)
        per_program = triton.cdiv(n_pos, programs) if n_pos else 0
        want_dw = ctx.needs_input_grad[1]
        # every program stores its row of partials (zeros where it has no position): no zero fill
        partial = torch.empty((programs, D), dtype=torch.float32, device=x.device) if want_dw else dx
        sc_b, sc_s = _angle_strides(cos)
        if n_pos:
            _norm_rope_bwd_kernel[(programs,)](
                dy, x, weight, cos, sin, rstd, dx, partial, S, H, n_pos, per_program, dy.stride(0), dy.stride(1),
                dy.stride(2), x.stride(0), x.stride(1), x.stride(2), dx.stride(0), dx.stride(1), dx.stride(2),
                sc_b, sc_s,
                HALF=D // 2, H_P2=max(2, triton.next_power_of_2(H)), COS_HALF_WIDTH=cos.shape[-1] != D,
                WANT_DW=want_dw, num_warps=4,
            )  # fmt: skip
        dw = sum_partials(partial, weight.dtype) if want_dw else None
        return dx, dw, None, None, None


def norm_rope(x_BHSD: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor):
    """RoPE(rms_norm(x) over the head dim) for x [B, H, S, D]; cos/sin [B or 1, S, D or D / 2] get no gradient."""
    check_triton_device(x_BHSD, "rope")
    if not supported(x_BHSD, weight, cos) or sin.shape != cos.shape or sin.stride() != cos.stride():
        raise ValueError(
            f"norm_rope kernel: unsupported shapes x {tuple(x_BHSD.shape)} weight {tuple(weight.shape)} "
            f"cos {tuple(cos.shape)}"
        )
    return _NormRope.apply(x_BHSD, weight, float(eps), cos.detach(), sin.detach())
