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
