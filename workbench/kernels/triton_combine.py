"""Triton weighted combine of expert outputs (imported lazily; see moe/dispatch/local.py).

out[t] = sum_k w[t, k] * y[row(t, k)] with the sum in float32. The torch path gathers the rows
([T, K, D] in y's dtype), upcasts them ([T, K, D] float32) and runs a batched [1, K] x [K, D]
product (a cuBLAS gemv per token); its backward does the same again plus a float32 [T, K, D]
gradient and a cast. These kernels read each expert row once per pass and keep the K-way sums in
registers: forward ~(K + 1) x D x 2 bytes per token instead of ~(7K + 1) x D x 2, backward
likewise, with no [T, K, D] temporaries at all (measured on H200 at T=8192, K=8, D=2048: the
torch combine's copies, gathers and gemvs took ~18 ms of a 157 ms step over 8 layers).

A slot whose row index is >= N (the rows of y) has no row: it adds nothing and its weight
gradient is 0. Dispatchers that send a token once per rank use it for the slots of experts on
other ranks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device

# Shape suffixes: T tokens, D hidden, K top-k, N routed rows.

BLOCK_D = 512
# The forward's columns per program. At 512 with 4 warps Triton lays the [K, 512] tile out as 2 warps of rows x
# 2 of columns (sizePerThread [1, 8], warpsPerCTA [2, 2] in its TTGIR, Triton 3.6 and 3.9 alike), so the sum over
# K crosses warps: shared memory and 9 barriers a program (the H200 profile: ~190 us a call, 1.2 TB/s, where the
# backward moves twice the bytes at 3.3 TB/s). At 1024 all 4 warps lie along the columns and each thread sums its
# K rows in registers (no shared memory, 16-byte loads and stores). tests/test_kernels.py compiles both for sm_90.
BLOCK_D_FWD = 1024


@triton.jit
def _combine_fwd_kernel(
    Y, W, ROWS, OUT, RES, stride_y, stride_out, stride_res, K, D, N,
    K_P2: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, HAS_W: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ks = tl.arange(0, K_P2)
    rows = tl.load(ROWS + t * K + ks, mask=ks < K, other=N).to(tl.int64)
    kmask = (ks < K) & (rows < N)
    tile = tl.load(
        Y + rows[:, None] * stride_y + cols[None, :], mask=kmask[:, None] & (cols[None, :] < D), other=0.0
    ).to(tl.float32)
    if HAS_W:
        w = tl.load(W + t * K + ks, mask=kmask, other=0.0).to(tl.float32)
        acc = tl.sum(w[:, None] * tile, axis=0)
    else:  # the rows already carry their weights (or none apply): a plain sum
        acc = tl.sum(tile, axis=0)
    if HAS_RES:  # a residual stream added to the sum before the one rounding (models/families/qwen3_moe/decoder.py)
        acc += tl.load(RES + t * stride_res + cols, mask=cols < D, other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=cols < D)


@triton.jit
def _combine_bwd_kernel(
    G, Y, W, ROWS, GY, GW, stride_g, stride_y, stride_gy, K, D, N, K_P2: tl.constexpr, BLOCK: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_P2)
    rows = tl.load(ROWS + t * K + ks, mask=ks < K, other=N).to(tl.int64)
    kmask = (ks < K) & (rows < N)
    w = tl.load(W + t * K + ks, mask=kmask, other=0.0).to(tl.float32)
    dw = tl.zeros((K_P2,), tl.float32)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cmask = cols < D
        g = tl.load(G + t * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)
        mask2 = kmask[:, None] & cmask[None, :]
        tile = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=mask2, other=0.0).to(tl.float32)
        dw += tl.sum(tile * g[None, :], axis=1)
        # each expert row belongs to exactly one (token, slot): plain stores, no atomics
        tl.store(
            GY + rows[:, None] * stride_gy + cols[None, :],
            (w[:, None] * g[None, :]).to(GY.dtype.element_ty),
            mask=mask2,
        )
    tl.store(GW + t * K + ks, dw.to(GW.dtype.element_ty), mask=ks < K)


def _k_p2(k: int) -> int:
    return max(2, triton.next_power_of_2(k))


def combine_forward(
    y_ND: torch.Tensor,
    weights_TK: torch.Tensor,
    row_of_slot: torch.Tensor,
    block: int = BLOCK_D_FWD,
    residual_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[t] = sum_k w[t, k] * y[row_of_slot[t*K + k]] (no term where the row is >= N), float32 sums.

    `block`: columns per program (a power of two; BLOCK_D_FWD, a benchmark knob otherwise). `residual_TD`: added
    to each token's sum before its rounding.
    """
    return _launch_forward(y_ND, weights_TK, row_of_slot, weights_TK.shape, block, residual_TD)


def sum_forward(
    y_ND: torch.Tensor, row_of_slot: torch.Tensor, top_k: int, residual_TD: torch.Tensor | None = None
) -> torch.Tensor:
    """out[t] = sum_k y[row_of_slot[t*K + k]] (+ residual[t]), float32 sums: combine_forward with unit weights."""
    if top_k < 1 or row_of_slot.numel() % top_k:
        raise ValueError(f"sum_forward: {row_of_slot.numel()} slots are not a whole number of tokens of top_k {top_k}")
    return _launch_forward(y_ND, None, row_of_slot, (row_of_slot.numel() // top_k, top_k), BLOCK_D_FWD, residual_TD)


def _launch_forward(y_ND, weights_TK, row_of_slot, tokens_by_k, block, residual_TD) -> torch.Tensor:
    check_triton_device(y_ND, "combine")
    y_ND = y_ND if y_ND.stride(-1) == 1 else y_ND.contiguous()
    T, K = tokens_by_k
    D = y_ND.shape[1]
    out_TD = torch.empty((T, D), dtype=y_ND.dtype, device=y_ND.device)
    if residual_TD is not None and (residual_TD.shape != (T, D) or residual_TD.stride(-1) != 1):
        raise ValueError(
            f"combine_forward: residual must be [{T}, {D}] with unit stride, got {tuple(residual_TD.shape)}"
        )
    if T and D:
        row_of_slot = row_of_slot.contiguous()
        _combine_fwd_kernel[(T, triton.cdiv(D, block))](
            y_ND,
            row_of_slot if weights_TK is None else weights_TK.contiguous(),
            row_of_slot,
            out_TD,
            out_TD if residual_TD is None else residual_TD,
            y_ND.stride(0),
            out_TD.stride(0),
            0 if residual_TD is None else residual_TD.stride(0),
            K,
            D,
            y_ND.shape[0],
            K_P2=_k_p2(K),
            BLOCK=block,
            HAS_RES=residual_TD is not None,
            HAS_W=weights_TK is not None,
            num_warps=4,
        )
    return out_TD


def combine_backward(
    grad_TD: torch.Tensor, y_ND: torch.Tensor, weights_TK: torch.Tensor, row_of_slot: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad wrt y [N, D] in y's dtype, grad wrt weights [T, K] in their dtype)."""
    check_triton_device(y_ND, "combine")
    y_ND = y_ND if y_ND.stride(-1) == 1 else y_ND.contiguous()
    T, K = weights_TK.shape
    N, D = y_ND.shape
    grad_TD = grad_TD.contiguous()
    # rows no slot points at (none when N == T * K) get no store: start them at zero
    alloc = torch.empty if N == T * K else torch.zeros
    grad_y_ND = alloc((N, D), dtype=y_ND.dtype, device=y_ND.device)
    grad_w_TK = torch.empty((T, K), dtype=weights_TK.dtype, device=weights_TK.device)
    if T and D:
        _combine_bwd_kernel[(T,)](
            grad_TD,
            y_ND,
            weights_TK.contiguous(),
            row_of_slot.contiguous(),
            grad_y_ND,
            grad_w_TK,
            grad_TD.stride(0),
            y_ND.stride(0),
            grad_y_ND.stride(0),
            K,
            D,
            N,
            K_P2=_k_p2(K),
            BLOCK=BLOCK_D,
            num_warps=4,
        )
    return grad_y_ND, grad_w_TK
