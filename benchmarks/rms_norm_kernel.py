"""The Triton RMSNorm kernels alone on a GPU: microseconds per call and bandwidth, per launch shape.

    python benchmarks/rms_norm_kernel.py

Qwen3-MoE's norms at 8192 tokens, bf16: the hidden norm (2048 wide, 8192 rows) and the per-head q norm (128 wide,
8192 x 32 rows). The profile of 2026-12-01 had `_rms_norm_bwd_kernel` at 3.46 ms per L8 step (~1 TB/s for ~3.5 GB
moved): each of its tiles ends in a sum over the row, across warps where a row spans several (16 warps, 2 rows of
2048 a tile). This times the product's launch shape (kernels/triton_rms_norm._launch_config) against other rows x
warps, the backward with its dW partial sums reduced, as the product runs it, and the backward as it was until
2026-12-03 (`backward_loop_dw_us`: dW summed over each tile's rows inside the loop, across warps); CUDA-event medians
of 50 calls after 5.
Bytes counted: forward x read and y written; backward dy and x read, dx written (rstd and dW partials left out).
"""

from __future__ import annotations

import functools
import json

import torch
import triton
import triton.language as tl
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path

from workbench.kernels._triton_util import num_programs_for
from workbench.kernels.triton_rms_norm import _launch_config, _rms_norm_bwd_kernel, _rms_norm_fwd_kernel, rms_norm

# Shape suffixes: M rows, N the normalized width.


@triton.jit
def _rms_norm_bwd_loop_dw_kernel(
    DY, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_x, stride_dx, M, N, tiles_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WANT_DW: tl.constexpr,
):  # fmt: skip
    # The backward until 2026-12-03, for the A/B: the weight gradient summed over each tile's rows inside the loop.
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    first_tile = pid * tiles_per_program
    for tile in range(first_tile, first_tile + tiles_per_program):
        rows = tl.arange(0, BLOCK_M).to(tl.int64) + tile * BLOCK_M
        rmask = rows < M
        mask = rmask[:, None] & cmask[None, :]
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        x_hat = x * rstd[:, None]
        if WANT_DW:
            dw_acc += tl.sum(dy * x_hat.to(X.dtype.element_ty).to(tl.float32), axis=0)
        g = (dy * w[None, :]).to(X.dtype.element_ty).to(tl.float32)
        dx = rstd[:, None] * (g - x_hat * (tl.sum(g * x_hat, axis=1) / N)[:, None])
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
    if WANT_DW:
        tl.store(DW_PARTIAL + pid * N + cols, dw_acc, mask=cmask)


def _fwd(x_MN, w, y_MN, rstd_M, rows, warps):
    M, N = x_MN.shape
    _rms_norm_fwd_kernel[(triton.cdiv(M, rows),)](
        x_MN, w, y_MN, rstd_M, x_MN.stride(0), y_MN.stride(0), M, N, 1e-6,
        BLOCK_M=rows, BLOCK_N=triton.next_power_of_2(N), num_warps=warps,
    )  # fmt: skip


def _bwd(dy_MN, x_MN, w, rstd_M, dx_MN, rows, warps, programs_per_sm, loop_dw=False):
    """The product's backward kernel at a launch shape, or (loop_dw) the earlier one, whose signature predates the
    residual gradient's arguments (DRES, its stride, HAS_DRES)."""
    M, N = x_MN.shape
    tiles = triton.cdiv(M, rows)
    sms = torch.cuda.get_device_properties(x_MN.device).multi_processor_count
    programs = min(tiles, programs_per_sm * sms) if programs_per_sm else num_programs_for(x_MN.device, tiles)
    dw_partial = torch.zeros((programs, N), dtype=torch.float32, device=x_MN.device)
    if loop_dw:
        _rms_norm_bwd_loop_dw_kernel[(programs,)](
            dy_MN, x_MN, w, rstd_M, dx_MN, dw_partial, dy_MN.stride(0), x_MN.stride(0), dx_MN.stride(0), M, N,
            triton.cdiv(tiles, programs), BLOCK_M=rows, BLOCK_N=triton.next_power_of_2(N), WANT_DW=True,
            num_warps=warps,
        )  # fmt: skip
    else:
        _rms_norm_bwd_kernel[(programs,)](
            dy_MN, x_MN, w, rstd_M, dx_MN, dw_partial, dx_MN, dy_MN.stride(0), x_MN.stride(0), dx_MN.stride(0), 0, M,
            N, triton.cdiv(tiles, programs), BLOCK_M=rows, BLOCK_N=triton.next_power_of_2(N), WANT_DW=True,
            HAS_DRES=False, num_warps=warps,
        )  # fmt: skip
    return dw_partial.sum(0)


def _us(fn) -> float:
    for _ in range(5):
        fn()
    return cuda_event_ms(fn, 50) * 1000


def main() -> None:
    for name, M, N in (("hidden", 8192, 2048), ("q_norm", 8192 * 32, 128)):
        x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(N, device="cuda", dtype=torch.bfloat16) + 0.5
        dy = torch.randn_like(x)
        y, dx, rstd = torch.empty_like(x), torch.empty_like(x), torch.empty(M, device="cuda")
        # the product's own path first (autograd function), as a check of the direct launches below
        xr = x.clone().requires_grad_()
        rms_norm(xr, w, 1e-6).backward(dy)
        product = _launch_config(N)
        shapes = sorted({product[::2], (1, 4), (1, 8), (2, 4), (2, 8), (4, 4), (4, 8), (8, 8), (16, 4), (32, 4)})
        rows_out = []
        for rows, warps in shapes:
            if rows * triton.next_power_of_2(N) > 65536:
                continue
            _fwd(x, w, y, rstd, rows, warps)
            _bwd(dy, x, w, rstd, dx, rows, warps, 0)
            torch.testing.assert_close(dx, xr.grad)  # every launch shape computes the product's gradient
            fwd_us = _us(functools.partial(_fwd, x, w, y, rstd, rows, warps))
            bwd = {p: _us(functools.partial(_bwd, dy, x, w, rstd, dx, rows, warps, p)) for p in (0, 2, 8)}
            loop_dw = _us(functools.partial(_bwd, dy, x, w, rstd, dx, rows, warps, 0, loop_dw=True))
            rows_out.append(
                {
                    "rows": rows,
                    "warps": warps,
                    "product": (rows, warps) == product[::2],
                    "forward_us": round(fwd_us, 1),
                    "forward_tb_s": round(2 * x.numel() * 2 / fwd_us / 1e6, 2),
                    "backward_us_by_programs_per_sm": {p or "product": round(us, 1) for p, us in bwd.items()},
                    "backward_tb_s": round(3 * x.numel() * 2 / bwd[0] / 1e6, 2),
                    "backward_loop_dw_us": round(loop_dw, 1),  # dW summed over rows inside the loop, as before
                }
            )
        print(json.dumps({"norm": name, "M": M, "N": N, "shapes": rows_out}), flush=True)


if __name__ == "__main__":
    main()
