"""The sum of squares of many gradients (the clipping norm's), one Triton launch per large tensor.

torch's `_foreach_norm` over the bf16 gradients of the Qwen3-30B-A3B L8 model took 4.6 ms per step on an
H200 (~2.4 TB/s; 10b's profile, 2026-12-02) for one read of ~11 GB. Here each program sums the squares of
a fixed span of one tensor in float32 and writes its partial sum to its own slot, and one torch sum adds
the slots: a fixed reduction order, so the norm is the same on every run. Small tensors (norm weights,
biases) stay with `_foreach_norm`, whose single launch covers many of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workbench.kernels._triton_util import triton_interpreting

BLOCK = 4096
ITERS = 8  # a program's span: BLOCK * ITERS elements
MIN_NUMEL = 1 << 20  # below this a tensor goes to _foreach_norm with the other small ones
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _sum_squares_kernel(X, PARTIAL, numel, first, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    start = pid * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(PARTIAL + first + pid, tl.sum(acc, axis=0))


def takes(g: torch.Tensor) -> bool:
    """Whether the kernel sums `g`: a large contiguous float tensor where Triton runs (not a DTensor)."""
    return (
        type(g) is torch.Tensor
        and (g.device.type == "cuda" or triton_interpreting())
        and g.dtype in _DTYPES
        and g.is_contiguous()
        and g.numel() >= MIN_NUMEL
    )


def sum_of_squares(grads: list[torch.Tensor]) -> torch.Tensor:
    """Σ ||g||² over `grads` (plain tensors on one device) as a float32 device scalar; no host sync."""
    if not grads:
        raise ValueError("sum_of_squares needs at least one tensor")
    large = [g for g in grads if takes(g)]
    small = [g for g in grads if not takes(g)]
    device = grads[0].device
    parts: list[torch.Tensor] = []
    if large:
        span = BLOCK * ITERS
        programs = [triton.cdiv(g.numel(), span) for g in large]
        partial = torch.empty(sum(programs), dtype=torch.float32, device=device)
        first = 0
        for g, n in zip(large, programs, strict=True):
            _sum_squares_kernel[(n,)](g, partial, g.numel(), first, BLOCK=BLOCK, ITERS=ITERS, num_warps=8)
            first += n
        parts.append(partial.sum())
    if small:
        norms = torch._foreach_norm(small, 2.0, dtype=torch.float32)
        parts.append(torch.stack(norms).square().sum())
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]
