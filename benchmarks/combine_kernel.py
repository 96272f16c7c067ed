"""The Triton combine kernels alone on a GPU: microseconds per call and the bandwidth they reach.

    python benchmarks/combine_kernel.py

Moonlight's (top-6) and Qwen3-MoE's (top-8) shapes at 8192 tokens, hidden 2048, bf16; CUDA-event medians of 50
calls after 5. Bytes: forward K + 1 rows per token, backward 2K + 1. On 2026-12-02 (1 x H200) a forward with
one program per token looping over the columns, as the backward does: 214 us (1.1 TB/s) at top-6,
224 us at top-8, no better than the per-512-column programs' ~190 us in the step's profile: reverted.
Candidate for the next call: `by_row`, the forward with each of the K rows loaded as its own [BLOCK] vector and
summed in registers (no reduction across the tile's K axis), checked against the product kernel before timing.
On 2026-12-03 a CPU analysis (the kernels compiled for sm_90, tests/test_kernels.py) that the product's forward at 512
columns a program summed K across two warps through shared memory, and at 1024 in registers: the product now runs
1024 (BLOCK_D_FWD); `forward_block512_us` times the old width beside it. `backward_sum_after_loop_us`: the
backward with its weight gradient summed after the column loop (more registers, fewer cross-warp sums).
"""

from __future__ import annotations

import functools
import json

import torch
import triton
import triton.language as tl
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path

from workbench.kernels.triton_combine import combine_backward, combine_forward

# Shape suffixes: T tokens, D hidden, K top-k, N routed rows.


@triton.jit
def _combine_fwd_by_row_kernel(Y, W, ROWS, OUT, stride_y, stride_out, K, D, N, K_P2: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    cmask = cols < D
    acc = tl.zeros((BLOCK,), tl.float32)
    for k in tl.static_range(K_P2):
        row = tl.load(ROWS + t * K + k, mask=k < K, other=N).to(tl.int64)  # a slot past K: no row
        w = tl.load(W + t * K + k, mask=k < K, other=0.0).to(tl.float32)
        acc += w * tl.load(Y + row * stride_y + cols, mask=cmask & (row + 0 * cols < N), other=0.0).to(tl.float32)
    tl.store(OUT + t * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=cmask)


def combine_forward_by_row(y_ND: torch.Tensor, weights_TK: torch.Tensor, row_of_slot: torch.Tensor, block: int = 512):
    """The candidate forward: what combine_forward computes, each expert row its own vector load."""
    T, K = weights_TK.shape
    D = y_ND.shape[1]
    out_TD = torch.empty((T, D), dtype=y_ND.dtype, device=y_ND.device)
    _combine_fwd_by_row_kernel[(T, triton.cdiv(D, block))](
        y_ND,
        weights_TK,
        row_of_slot,
        out_TD,
        y_ND.stride(0),
        out_TD.stride(0),
        K,
        D,
        y_ND.shape[0],
        K_P2=max(2, triton.next_power_of_2(K)),
        BLOCK=block,
        num_warps=4,
    )
    return out_TD


@triton.jit
def _combine_bwd_sum_after_kernel(
    G, Y, W, ROWS, GY, GW, stride_g, stride_y, stride_gy, K, D, N, K_P2: tl.constexpr, BLOCK: tl.constexpr
):
    # Candidate backward: the weight gradient kept per element of the tile and summed over the columns once after
    # the loop (no cross-warp sum per iteration), at the cost of registers (64 -> 96 at top-8 in the sm_90 cubin).
    t = tl.program_id(0).to(tl.int64)
    ks = tl.arange(0, K_P2)
    rows = tl.load(ROWS + t * K + ks, mask=ks < K, other=N).to(tl.int64)
    kmask = (ks < K) & (rows < N)
    w = tl.load(W + t * K + ks, mask=kmask, other=0.0).to(tl.float32)
    dw_tile = tl.zeros((K_P2, BLOCK), tl.float32)
    for start in range(0, D, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        cmask = cols < D
        g = tl.load(G + t * stride_g + cols, mask=cmask, other=0.0).to(tl.float32)
        mask2 = kmask[:, None] & cmask[None, :]
        tile = tl.load(Y + rows[:, None] * stride_y + cols[None, :], mask=mask2, other=0.0).to(tl.float32)
        dw_tile += tile * g[None, :]
        gy = (w[:, None] * g[None, :]).to(GY.dtype.element_ty)
        tl.store(GY + rows[:, None] * stride_gy + cols[None, :], gy, mask=mask2)
    tl.store(GW + t * K + ks, tl.sum(dw_tile, axis=1).to(GW.dtype.element_ty), mask=ks < K)


def combine_backward_sum_after(grad_TD, y_ND, weights_TK, row_of_slot):
    """The candidate backward: what combine_backward computes (every slot has a row here: N == T * K)."""
    T, K = weights_TK.shape
    N, D = y_ND.shape
    grad_y_ND = torch.empty_like(y_ND)
    grad_w_TK = torch.empty_like(weights_TK)
    _combine_bwd_sum_after_kernel[(T,)](
        grad_TD, y_ND, weights_TK, row_of_slot, grad_y_ND, grad_w_TK, grad_TD.stride(0), y_ND.stride(0),
        grad_y_ND.stride(0), K, D, N, K_P2=max(2, triton.next_power_of_2(K)), BLOCK=512, num_warps=4,
    )  # fmt: skip
    return grad_y_ND, grad_w_TK


def _median_us(fn, reps: int = 50) -> float:
    for _ in range(5):
        fn()
    return cuda_event_ms(fn, reps) * 1000


def main() -> None:
    tokens, hidden = 8192, 2048
    for top_k in (6, 8):
        rows = tokens * top_k
        y = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(tokens, top_k, device="cuda")
        row_of_slot = torch.randperm(rows, device="cuda")
        g = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        fwd = _median_us(functools.partial(combine_forward, y, w, row_of_slot))
        # the product's forward until 2026-12-03 (512 columns a program: a cross-warp sum over K)
        fwd_512 = _median_us(functools.partial(combine_forward, y, w, row_of_slot, 512))
        torch.testing.assert_close(combine_forward_by_row(y, w, row_of_slot), combine_forward(y, w, row_of_slot))
        by_row = {
            b: _median_us(functools.partial(combine_forward_by_row, y, w, row_of_slot, b)) for b in (256, 512, 1024)
        }
        bwd = _median_us(functools.partial(combine_backward, g, y, w, row_of_slot))
        got_y, got_w = combine_backward_sum_after(g, y, w, row_of_slot)
        want_y, want_w = combine_backward(g, y, w, row_of_slot)
        torch.testing.assert_close(got_y, want_y)
        # the weight gradient is a float32 sum over D in another order: equal to float32 rounding of D terms
        torch.testing.assert_close(got_w, want_w, rtol=1e-3, atol=1e-4)
        bwd_after = _median_us(functools.partial(combine_backward_sum_after, g, y, w, row_of_slot))
        row_bytes = hidden * 2
        print(
            json.dumps(
                {
                    "top_k": top_k,
                    "forward_us": round(fwd, 1),
                    "forward_tb_s": round(tokens * (top_k + 1) * row_bytes / fwd / 1e6, 2),
                    "forward_block512_us": round(fwd_512, 1),
                    "by_row_us": {b: round(us, 1) for b, us in by_row.items()},
                    "backward_us": round(bwd, 1),
                    "backward_tb_s": round(tokens * (2 * top_k + 1) * row_bytes / bwd / 1e6, 2),
                    "backward_sum_after_loop_us": round(bwd_after, 1),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
