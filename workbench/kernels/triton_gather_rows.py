"""Triton row gather out[i] = x[index[i]] for the dispatch's copies (imported lazily; see moe/dispatch/local.py).

The local dispatch copies each token to its k expert rows in the forward, and the combine of rows that carry their
routing weights copies each token's gradient to its rows in the backward: two [N, D] gathers a layer (Qwen3 at
8192 tokens x top-8: 65,536 rows of 2048, 256 MB written). torch's index_select runs them as one 256-thread block
a row, each thread moving 16 bytes once (`vectorized_gather_kernel`): the H200 profile of session 21 has
123-132 us a call, ~2 TB/s of writes where the combine's kernel, the same rows the other way, reads them at
3.5 TB/s. Here a program copies ROWS whole rows (16 KB in flight at D = 2048) with 16-byte accesses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# Shape suffixes: T source rows (tokens), N gathered rows, D row width.

ELEMENTS_PER_PROGRAM = 8192  # ROWS x BLOCK_D


@triton.jit
def _gather_rows_kernel(
    X, INDEX, OUT, N, D, stride_x, stride_out, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = rows < N
    src = tl.load(INDEX + rows, mask=rmask, other=0).to(tl.int64)
    mask = rmask[:, None] & (cols[None, :] < D)
    tile = tl.load(X + src[:, None] * stride_x + cols[None, :], mask=mask)
    tl.store(OUT + rows[:, None].to(tl.int64) * stride_out + cols[None, :], tile, mask=mask)


def launch_shape(width: int) -> tuple[int, int]:
    """(ROWS, BLOCK_D) for rows of `width` elements: whole rows up to 2048 wide, ELEMENTS_PER_PROGRAM a program."""
    block_d = min(triton.next_power_of_2(max(width, 1)), 2048)
    return max(1, ELEMENTS_PER_PROGRAM // block_d), block_d


def gather_rows(x_TD: torch.Tensor, index_N: torch.Tensor) -> torch.Tensor:
    """x[index] along dim 0 for a 2-D x and 1-D in-range indices (the dispatch's own; not checked on the device)."""
    check_triton_device(x_TD, "combine")
    if x_TD.dim() != 2 or index_N.dim() != 1:
        raise ValueError(f"gather_rows: x must be 2-D and index 1-D, got {tuple(x_TD.shape)}, {tuple(index_N.shape)}")
    x_TD = x_TD if x_TD.stride(-1) == 1 else x_TD.contiguous()
    N, D = index_N.numel(), x_TD.shape[1]
    out_ND = torch.empty((N, D), dtype=x_TD.dtype, device=x_TD.device)
    if N and D:
        rows, block_d = launch_shape(D)
        _gather_rows_kernel[(triton.cdiv(N, rows), triton.cdiv(D, block_d))](
            x_TD, index_N.contiguous(), out_ND, N, D, x_TD.stride(0), out_ND.stride(0),
            ROWS=rows, BLOCK_D=block_d, num_warps=8,
        )  # fmt: skip
    return out_ND
