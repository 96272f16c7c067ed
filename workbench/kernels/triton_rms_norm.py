"""Triton RMSNorm: one fused forward kernel and one fused backward kernel (imported lazily).

Numerics follow Qwen3MoeRMSNorm: float32 statistics, the normalized value rounded to the input
dtype before the weight multiply, output in promote(input dtype, weight dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device, num_programs_for

MAX_FUSED_WIDTH = 65536  # one row per program must fit on chip


@triton.jit
def _rms_norm_fwd_kernel(X, W, Y, RSTD, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    x_hat = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * x_hat).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx,
                         M, N, rows_per_program, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    # advance pointers row by row from an int64 base offset, so large activations cannot overflow
    base = row_start.to(tl.int64)
    DY += base * stride_dy
    X += base * stride_x
    DX += base * stride_dx
    RSTD += base
    for _ in range(row_start, row_end):
        dy = tl.load(DY + cols, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD)
        x_hat = x * rstd
        dw_acc += dy * x_hat.to(X.dtype.element_ty).to(tl.float32)
        # autograd rounds d(x_hat) to the input dtype (the cast in the forward); do the same
        g = (dy * w).to(X.dtype.element_ty).to(tl.float32)
        dx = rstd * (g - x_hat * (tl.sum(g * x_hat, axis=0) / N))
        tl.store(DX + cols, dx.to(DX.dtype.element_ty), mask=mask)
        DY += stride_dy
        X += stride_x
        DX += stride_dx
        RSTD += 1
    tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=mask)


def _launch_config(n: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n)
    return block, min(max(block // 256, 1), 16)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        shape = x.shape
        x_MN = x.reshape(-1, shape[-1])
        if x_MN.stride(-1) != 1:
            x_MN = x_MN.contiguous()
        weight = weight.contiguous()
        M, N = x_MN.shape
        y_MN = torch.empty((M, N), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
        rstd_M = torch.empty(M, dtype=torch.float32, device=x.device)
        block, warps = _launch_config(N)
        if M > 0:
            _rms_norm_fwd_kernel[(M,)](x_MN, weight, y_MN, rstd_M, x_MN.stride(0), y_MN.stride(0),
                                       N, eps, BLOCK_N=block, num_warps=warps)
        ctx.save_for_backward(x_MN, weight, rstd_M)
        ctx.shape = shape
        return y_MN.view(shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_MN, weight, rstd_M = ctx.saved_tensors
        M, N = x_MN.shape
        dy_MN = dy.reshape(M, N)
        if dy_MN.stride(-1) != 1:
            dy_MN = dy_MN.contiguous()
        dx_MN = torch.empty_like(x_MN)
        programs = max(num_programs_for(x_MN.device, M), 1)
        dw_partial = torch.zeros((programs, N), dtype=torch.float32, device=x_MN.device)
        block, warps = _launch_config(N)
        if M > 0:
            _rms_norm_bwd_kernel[(programs,)](dy_MN, x_MN, weight, rstd_M, dx_MN, dw_partial,
                                              dy_MN.stride(0), x_MN.stride(0), dx_MN.stride(0),
                                              M, N, triton.cdiv(M, programs),
                                              BLOCK_N=block, num_warps=warps)
        dw = dw_partial.sum(0).to(weight.dtype)
        return dx_MN.view(ctx.shape), dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused RMSNorm (forward and backward in one Triton kernel each)."""
    check_triton_device(x, "rms_norm")
    if x.shape[-1] > MAX_FUSED_WIDTH:
        raise ValueError(f"rms_norm='triton' handles widths up to {MAX_FUSED_WIDTH}, got {x.shape[-1]}; "
                         "use backend='torch'")
    return _RMSNormFunction.apply(x, weight, eps)
