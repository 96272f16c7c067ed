"""The clipping norm's sum of squares alone on a GPU: the product's kernel against the loop it replaced.

    python benchmarks/sum_squares_kernel.py

The gradients of the Qwen3-30B-A3B architecture at 8 layers (bf16: embedding, lm_head, and per layer q/k/v/o and the
fused experts' gate_up and down; the small ones go to torch's _foreach_norm in either case, so they are left out):
~11.2 GB read once. The session-15 profile had `_sum_squares_kernel` at 6.08 ms a step (1.84 TB/s): its program
looped over ITERS blocks, 32 bytes in flight a thread. The product now issues the ITERS loads unrolled
(`tl.static_range`); `loop_ms` is the loop version, kept here for the A/B. CUDA-event medians of 20 calls after 3;
both must give the same bits.
"""

from __future__ import annotations

import json

import torch
import triton
import triton.language as tl
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path

from workbench.kernels.triton_sum_squares import BLOCK, ITERS, programs_for, sum_of_squares


@triton.jit
def _sum_squares_loop_kernel(X, PARTIAL, numel, first, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    # The kernel before session 15, for the A/B: one block's loads at a time.
    pid = tl.program_id(0).to(tl.int64)
    start = pid * BLOCK * ITERS
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for i in range(ITERS):
        offs = start + i * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(X + offs, mask=offs < numel, other=0.0).to(tl.float32)
        acc += x * x
    tl.store(PARTIAL + first + pid, tl.sum(acc, axis=0))


def _loop_sum(grads: list[torch.Tensor]) -> torch.Tensor:
    partial = torch.empty(sum(programs_for(g.numel()) for g in grads), dtype=torch.float32, device=grads[0].device)
    first = 0
    for g in grads:
        n = programs_for(g.numel())
        _sum_squares_loop_kernel[(n,)](g, partial, g.numel(), first, BLOCK=BLOCK, ITERS=ITERS, num_warps=8)
        first += n
    return partial.sum()


def qwen3_l8_grads(layers: int = 8) -> list[torch.Tensor]:
    """Random bf16 tensors shaped as the large gradients of the Qwen3-30B-A3B architecture (fresh values, not zeros)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(151936, 2048)]
    for _ in range(layers):
        shapes += [(4096, 2048), (512, 2048), (512, 2048), (2048, 4096), (128, 1536, 2048), (128, 2048, 768)]
    shapes.append((151936, 2048))
    return [torch.randn(s, device="cuda", generator=g, dtype=torch.bfloat16) * 1e-3 for s in shapes]


def main() -> None:
    grads = qwen3_l8_grads()
    nbytes = sum(t.numel() * t.element_size() for t in grads)
    product, loop = sum_of_squares(grads), _loop_sum(grads)
    ref = sum(t.double().square().sum() for t in grads)
    assert torch.equal(product, loop), (float(product), float(loop))
    assert abs(float(product) - float(ref)) / float(ref) < 1e-5
    out = {"gbytes": nbytes / 1e9, "tensors": len(grads)}
    for name, fn in (("product_ms", lambda: sum_of_squares(grads)), ("loop_ms", lambda: _loop_sum(grads))):
        for _ in range(3):
            fn()
        out[name] = cuda_event_ms(fn, 20)
        out[name.replace("_ms", "_tb_s")] = nbytes / out[name] / 1e9
    print("sum_squares", json.dumps(out))


if __name__ == "__main__":
    main()
