"""Triton RMSNorm: one fused forward kernel and one fused backward kernel (imported lazily).

Numerics follow Qwen3MoeRMSNorm: float32 statistics, the normalized value rounded to the input
dtype before the weight multiply, output in promote(input dtype, weight dtype).
A zero-centered norm (OFFSET=1: Qwen3.5-MoE's, Qwen3-Next's, Gemma's, scale 1 + weight) follows those classes instead:
the weight plus the offset in float32 (a bf16 weight near zero is not rounded as 1 + w), times the float32 normalized
value, rounded once to the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device, num_programs_for

# Shape suffixes: M rows, N the normalized width.

MAX_FUSED_WIDTH = 65536  # one row per program must fit on chip


@triton.jit
def _rms_norm_fwd_kernel(
    X,
    W,
    Y,
    RSTD,
    stride_x,
    stride_y,
    M,
    N,
    eps,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    OFFSET: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < M
    mask = rmask[:, None] & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / N + eps)
    tl.store(RSTD + rows, rstd, mask=rmask)
    x_hat = x * rstd[:, None]
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    if OFFSET == 0.0:  # Qwen3MoeRMSNorm rounds the normalized value to the input dtype before the weight multiply
        x_hat = x_hat.to(X.dtype.element_ty).to(tl.float32)
    else:  # the zero-centered classes multiply by (offset + weight) in float32 and round the product once
        w += OFFSET
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], (w[None, :] * x_hat).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY,
    X,
    W,
    RSTD,
    DX,
    DW_PARTIAL,
    DRES,
    stride_dy,
    stride_x,
    stride_dx,
    stride_dres,
    M,
    N,
    tiles_per_program,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WANT_DW: tl.constexpr,
    HAS_DRES: tl.constexpr,
    OFFSET: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    if OFFSET != 0.0:  # d(offset + w)/dw = 1: the weight's gradient is the same sum either way
        w += OFFSET
    # dW summed per element of the tile in registers, over rows once after the loop: a sum over the tile's rows in
    # every iteration crossed warps (shared memory and barriers per tile; 10 of its 11 barriers at the q norm's
    # 32 x 128 tiles, compiled for sm_90)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first_tile = pid * tiles_per_program
    for tile in range(first_tile, first_tile + tiles_per_program):
        # int64 row indices, so large activations cannot overflow the offsets
        rows = tl.arange(0, BLOCK_M).to(tl.int64) + tile * BLOCK_M
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        x_hat = x * rstd[:, None]
        if OFFSET == 0.0:
            if WANT_DW:
                dw_acc += dy * x_hat.to(X.dtype.element_ty).to(tl.float32)
            # autograd rounds d(x_hat) to the input dtype (the cast in the forward); do the same
            g = (dy * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
        else:  # the zero-centered forward keeps x_hat in float32: no rounding either way
            if WANT_DW:
                dw_acc += dy * x_hat
            g = dy * w[None, :]
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / N)[:, None])
        if HAS_DRES:  # the residual stream's gradient, which autograd would add in a kernel of its own
            dx += tl.load(DRES + rows[:, None] * stride_dres + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WANT_DW:
        tl.store(DW_PARTIAL + pid * N + cols, tl.sum(dw_acc, axis=0), mask=cmask)


@triton.jit
def _sum_partials_kernel(PARTIAL, OUT, R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    # column block of the [R, N] float32 partials summed over rows in a fixed order, stored in OUT's dtype
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for start in range(0, R, BLOCK_R):
        rows = start + tl.arange(0, BLOCK_R)
        tile = tl.load(
            PARTIAL + rows[:, None] * N + cols[None, :], mask=(rows < R)[:, None] & cmask[None, :], other=0.0
        )
        acc += tl.sum(tile, axis=0)
    tl.store(OUT + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


def sum_partials(partial_RN: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """partial.sum(0) in `dtype`, one launch, a fixed order (the backward's dW from its per-program partials).

    torch's column reduction of the [4 x SMs, N] partials and the cast after it took ~18 us a norm on H200
    (33 norms a Qwen3-30B-A3B L8 step): one narrow program per 16 columns reads its rows in a few wide tiles.
    """
    R, N = partial_RN.shape
    out = torch.empty(N, dtype=dtype, device=partial_RN.device)
    if N:
        _sum_partials_kernel[(triton.cdiv(N, 16),)](partial_RN, out, R, N, BLOCK_R=128, BLOCK_N=16, num_warps=4)
    return out


def _launch_config(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): narrow rows (Qwen3's per-head q/k norms, 128 wide) go
    several to a program; one 128-wide row per program left most of each warp's lanes idle."""
    block = triton.next_power_of_2(n)
    rows = max(1, min(64, 4096 // block))
    return rows, block, min(max(rows * block // 256, 1), 16)


def _output_dtype(x: torch.Tensor, weight: torch.Tensor, offset: float) -> torch.dtype:
    """Qwen3MoeRMSNorm's promote(input, weight); the zero-centered classes return the input's dtype (type_as)."""
    return x.dtype if offset else torch.promote_types(x.dtype, weight.dtype)


def _forward(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(y [M, N], x as [M, N] rows, rstd [M]) of the forward kernel."""
    x_MN = x.reshape(-1, x.shape[-1])
    if x_MN.stride(-1) != 1:
        x_MN = x_MN.contiguous()
    M, N = x_MN.shape
    y_MN = torch.empty((M, N), dtype=_output_dtype(x, weight, offset), device=x.device)
    rstd_M = torch.empty(M, dtype=torch.float32, device=x.device)
    rows, block, warps = _launch_config(N)
    if M > 0:
        _rms_norm_fwd_kernel[(triton.cdiv(M, rows),)](
            x_MN,
            weight,
            y_MN,
            rstd_M,
            x_MN.stride(0),
            y_MN.stride(0),
            M,
            N,
            eps,
            BLOCK_M=rows,
            BLOCK_N=block,
            OFFSET=float(offset),
            num_warps=warps,
        )
    return y_MN, x_MN, rstd_M


def _backward(
    dy: torch.Tensor,
    x_MN: torch.Tensor,
    weight: torch.Tensor,
    rstd_M: torch.Tensor,
    want_dw: bool,
    offset: float,
    d_res: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(dx [M, N], dw or None) of the backward kernel; `d_res` (the shape of x) is added to dx in the same pass."""
    M, N = x_MN.shape
    dy_MN = dy.reshape(M, N)
    if dy_MN.stride(-1) != 1:
        dy_MN = dy_MN.contiguous()
    dres_MN = None if d_res is None else d_res.reshape(M, N)
    if dres_MN is not None and dres_MN.stride(-1) != 1:
        dres_MN = dres_MN.contiguous()
    dx_MN = torch.empty_like(x_MN)
    rows, block, warps = _launch_config(N)
    tiles = triton.cdiv(M, rows)
    programs = max(num_programs_for(x_MN.device, tiles), 1)
    # every program stores its row of partials (rows past M add zeros): no zero fill unless nothing runs
    make = torch.empty if M > 0 else torch.zeros
    dw_partial = make((programs, N), dtype=torch.float32, device=x_MN.device) if want_dw else dx_MN
    if M > 0:
        _rms_norm_bwd_kernel[(programs,)](
            dy_MN,
            x_MN,
            weight,
            rstd_M,
            dx_MN,
            dw_partial,
            dx_MN if dres_MN is None else dres_MN,
            dy_MN.stride(0),
            x_MN.stride(0),
            dx_MN.stride(0),
            0 if dres_MN is None else dres_MN.stride(0),
            M,
            N,
            triton.cdiv(tiles, programs),
            BLOCK_M=rows,
            BLOCK_N=block,
            WANT_DW=want_dw,
            HAS_DRES=dres_MN is not None,
            OFFSET=float(offset),
            num_warps=warps,
        )
    return dx_MN, (sum_partials(dw_partial, weight.dtype) if want_dw else None)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
        weight = weight.contiguous()
        y_MN, x_MN, rstd_M = _forward(x, weight, eps, offset)
        ctx.save_for_backward(x_MN, weight, rstd_M)
        ctx.shape, ctx.offset = x.shape, offset
        return y_MN.view(x.shape)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x_MN, weight, rstd_M = ctx.saved_tensors
        # A frozen weight (LoRA's norms) needs no gradient: no partial sums, their zeroing and reduction (3 launches)
        dx_MN, dw = _backward(dy, x_MN, weight, rstd_M, ctx.needs_input_grad[1], ctx.offset)
        return dx_MN.view(ctx.shape), dw, None, None


class _RMSNormResidualFunction(torch.autograd.Function):
    """(rms_norm(x), x): the second output carries the residual stream on; its gradient is added to the norm's
    input gradient inside the backward kernel, where autograd would add the two in a kernel of its own."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0):
        weight = weight.contiguous()
        y_MN, x_MN, rstd_M = _forward(x, weight, eps, offset)
        ctx.save_for_backward(x_MN, weight, rstd_M)
        ctx.shape, ctx.offset = x.shape, offset
        ctx.set_materialize_grads(False)  # an unused output's gradient stays None, not a zero tensor to add
        return y_MN.view(x.shape), x.view_as(x)

    @staticmethod
    def backward(ctx, dy: torch.Tensor | None, d_res: torch.Tensor | None):
        x_MN, weight, rstd_M = ctx.saved_tensors
        if dy is None:  # only the residual was used
            return d_res, None, None, None
        dx_MN, dw = _backward(dy, x_MN, weight, rstd_M, ctx.needs_input_grad[1], ctx.offset, d_res)
        return dx_MN.view(ctx.shape), dw, None, None


def _check_input(x: torch.Tensor) -> None:
    """A device the kernels run on and a row that fits on chip, or a clear error."""
    check_triton_device(x, "rms_norm")
    if x.shape[-1] > MAX_FUSED_WIDTH:
        raise ValueError(
            f"rms_norm='triton' handles widths up to {MAX_FUSED_WIDTH}, got {x.shape[-1]}; use backend='torch'"
        )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Fused RMSNorm (forward and backward in one Triton kernel each); scale (offset + weight)."""
    _check_input(x)
    return _RMSNormFunction.apply(x, weight, eps, float(offset))


def rms_norm_residual(
    x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x), x), the input's gradient from both summed in the norm's backward kernel."""
    _check_input(x)
    return _RMSNormResidualFunction.apply(x, weight, eps, float(offset))
