"""Triton embedding gradient: every row of the table written once, with its sum of squares (imported lazily).

Torch's embedding backward zero-fills the whole [V, D] gradient and then adds the tokens' rows into it (sort,
segment sums, scatter); the clipping norm then reads the [V, D] gradient again. At Qwen3-30B-A3B's vocabulary
(151,936 x 2048 bf16) that is 622 MB written twice and read once more. Here one program a table row writes its
row once: the sum of its tokens' gradients (float32, in the tokens' order, rounded once), or zeros, and the sum of
squares of what it stored, which the norm takes instead of reading the gradient (kernels/grad_squares.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import check_triton_device
from workbench.kernels.sorting import ends_of_sorted, stable_sort

# Shape suffixes: T tokens, D the embedding width, V table rows.


# Token rows a program loads at once: a table row many tokens share (a frequent token, a constant batch) is summed
# 4 rows in flight at a time instead of one after another.
BLOCK_T = 4
BLOCK_D = 1024


@triton.jit
def _embedding_bwd_kernel(
    G, ORDER, ENDS, DW, PARTIALS, stride_g, stride_dw, D, PAD,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, HAS_PAD: tl.constexpr,
):  # fmt: skip
    v = tl.program_id(0)
    start = tl.load(ENDS + v - 1, mask=v > 0, other=0)
    end = tl.load(ENDS + v)
    if HAS_PAD:  # the padding row gets no gradient, as nn.Embedding(padding_idx=...) gives it none
        end = tl.where(v == PAD, start, end)
    squares = tl.zeros((BLOCK_D,), tl.float32)
    for col in range(0, D, BLOCK_D):
        cols = col + tl.arange(0, BLOCK_D)
        mask = cols < D
        acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
        for i in range(start, end, BLOCK_T):  # this row's tokens in the tokens' order: a fixed sum, no atomics
            slots = i + tl.arange(0, BLOCK_T)
            tmask = slots < end
            t = tl.load(ORDER + slots, mask=tmask, other=0).to(tl.int64)
            tile = tl.load(G + t[:, None] * stride_g + cols[None, :], mask=tmask[:, None] & mask[None, :], other=0.0)
            acc += tile.to(tl.float32)
        out = tl.sum(acc, axis=0).to(DW.dtype.element_ty)
        tl.store(DW + v.to(tl.int64) * stride_dw + cols, out, mask=mask)
        stored = out.to(tl.float32)
        squares += stored * stored
    tl.store(PARTIALS + v, tl.sum(squares, axis=0))


def embedding_backward(
    grad_TD: torch.Tensor, ids_T: torch.Tensor, num_rows: int, padding_idx: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the table's gradient [V, D] in the gradient's dtype, float32 Σ grad² per table row [V])."""
    check_triton_device(grad_TD, "embedding")
    grad_TD = grad_TD.reshape(-1, grad_TD.shape[-1])
    grad_TD = grad_TD if grad_TD.stride(-1) == 1 else grad_TD.contiguous()
    ids_T = ids_T.reshape(-1)
    if ids_T.shape[0] != grad_TD.shape[0]:
        raise ValueError(f"embedding_backward: {ids_T.shape[0]} ids for {grad_TD.shape[0]} gradient rows")
    D = grad_TD.shape[1]
    sorted_T, order_T = stable_sort(ids_T, max(num_rows - 1, 0))
    order_T = order_T.to(torch.int32)
    ends_V = ends_of_sorted(sorted_T, num_rows).to(torch.int32)
    grad_VD = torch.empty((num_rows, D), dtype=grad_TD.dtype, device=grad_TD.device)
    partials_V = torch.empty(num_rows, dtype=torch.float32, device=grad_TD.device)
    if num_rows and D:
        block = min(triton.next_power_of_2(D), BLOCK_D)
        _embedding_bwd_kernel[(num_rows,)](
            grad_TD,
            order_T,
            ends_V,
            grad_VD,
            partials_V,
            grad_TD.stride(0),
            grad_VD.stride(0),
            D,
            -1 if padding_idx is None else padding_idx,
            BLOCK_T=BLOCK_T,
            BLOCK_D=block,
            HAS_PAD=padding_idx is not None,
            num_warps=4,
        )
    return grad_VD, partials_V
