"""Matrix products with a float32 result from bf16/fp16 operands, on tensor cores.

A bf16 x bf16 product is exact in float32, so cuBLAS's `out_dtype=float32` GEMM gives what
`a.float() @ b.float()` gives up to the order of the float32 sums, at bf16 tensor-core speed
instead of float32 FMA speed (the router's [T, D] x [D, E] products ran on FMA units: ~2.6 ms
per training step at L8). A float32 operand against a bf16 one is split into a bf16 high part and
a bf16 remainder, a = hi + lo to 16 significant bits, and both parts are multiplied: relative
error <= 2^-17 per element, far below the bf16 rounding every caller applies to the result. Elsewhere (CPU,
float32 x float32) the plain float32 matmul runs.
"""

from __future__ import annotations

import torch

# Shape suffixes: M rows, K depth, N columns.

LOW_PRECISION = (torch.bfloat16, torch.float16)


def _split(a: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
    """`a` as a list of `dtype` tensors that sum to it (one when it already is `dtype`)."""
    if a.dtype == dtype:
        return [a]
    hi = a.to(dtype)
    return [hi, (a.float() - hi.float()).to(dtype)]


def tensor_core_path(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether mm_fp32(a, b) runs as low-precision GEMMs with a float32 result (CUDA, bf16/fp16 in)."""
    low = [t.dtype for t in (a, b) if t.dtype in LOW_PRECISION]
    return (
        a.is_cuda
        and b.is_cuda
        and bool(low)
        and all(d == low[0] for d in low)
        and all(t.dtype in LOW_PRECISION + (torch.float32,) for t in (a, b))
    )


def mm_fp32(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, accumulate: bool = False
) -> torch.Tensor:
    """a @ b in float32 (into `out`, or added to it when `accumulate`); see the module docstring."""
    if accumulate and out is None:
        raise ValueError("accumulate=True needs an out tensor to add to")
    if not tensor_core_path(a, b):
        a32, b32 = a.float(), b.float()
        if out is None:
            return a32 @ b32
        return out.addmm_(a32, b32) if accumulate else torch.mm(a32, b32, out=out)
    dtype = a.dtype if a.dtype in LOW_PRECISION else b.dtype
    pairs = [(x, b) for x in _split(a, dtype)] if b.dtype == dtype else [(a, y) for y in _split(b, dtype)]
    for i, (x, y) in enumerate(pairs):
        if out is None:
            out = torch.mm(x, y, out_dtype=torch.float32)
        elif accumulate or i > 0:
            torch.addmm(out, x, y, out_dtype=torch.float32, out=out)
        else:
            torch.mm(x, y, out_dtype=torch.float32, out=out)
    return out


def split_pair(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Float32 `a` [M, K] as one [M, 2K] `dtype` tensor: its rounding, then the remainder (a to ~16 bits, as _split)."""
    rows, cols = a.shape
    pair = torch.empty(rows, 2 * cols, dtype=dtype, device=a.device)
    hi = pair[:, :cols]
    hi.copy_(a)
    pair[:, cols:].copy_(a - hi.float())
    return pair


def mm_pair(pair_M2K: torch.Tensor, b_KN: torch.Tensor, add_MN: torch.Tensor | None = None) -> torch.Tensor:
    """add + (hi + lo) @ b for a split_pair: one GEMM of depth 2K against b stacked twice, in b's dtype.

    Where mm_fp32 runs one GEMM per part into a float32 result that its caller casts and autograd then adds to
    another gradient (four passes over an [M, N] result), the pair's two products share one float32 accumulator
    and the addend is read in the GEMM's epilogue: one store. The roundings are those passes' own: cuBLAS's
    bias-add epilogue rounds the product to b's dtype before it adds (measured on the H200,
    benchmarks/pair_gemm_check.py), as the cast did before autograd's add; CPU rounds the sum once.
    """
    b_2KN = torch.cat([b_KN, b_KN])
    return torch.mm(pair_M2K, b_2KN) if add_MN is None else torch.addmm(add_MN, pair_M2K, b_2KN)


def mm_pair_t(pair_M2K: torch.Tensor, x_MN: torch.Tensor) -> torch.Tensor:
    """(hi + lo)^T @ x in float32 [K, N] for a split_pair: one GEMM of 2K rows, its two halves summed."""
    cols = pair_M2K.shape[1] // 2
    if pair_M2K.is_cuda:
        both_2KN = torch.mm(pair_M2K.t(), x_MN, out_dtype=torch.float32)
    else:  # no float32-result GEMM of low-precision operands on CPU: the float32 products are the same
        both_2KN = pair_M2K.t().float() @ x_MN.float()
    return both_2KN[:cols] + both_2KN[cols:]
