"""The Triton combine kernels alone on a GPU: microseconds per call and the bandwidth they reach.

    python benchmarks/combine_kernel.py

Moonlight's (top-6) and Qwen3-MoE's (top-8) shapes at 8192 tokens, hidden 2048, bf16; CUDA-event medians of 50
calls after 5. Bytes: forward K + 1 rows per token, backward 2K + 1. Session 11 (gpu_session11e.sh) measured a
forward with one program per token looping over the columns, as the backward does: 214 us (1.1 TB/s) at top-6,
224 us at top-8, no better than the per-512-column programs' ~190 us in the step's profile; it was reverted.
"""

from __future__ import annotations

import functools
import json

import torch
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path

from workbench.kernels.triton_combine import combine_backward, combine_forward


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
        bwd = _median_us(functools.partial(combine_backward, g, y, w, row_of_slot))
        row_bytes = hidden * 2
        print(
            json.dumps(
                {
                    "top_k": top_k,
                    "forward_us": round(fwd, 1),
                    "forward_tb_s": round(tokens * (top_k + 1) * row_bytes / fwd / 1e6, 2),
                    "backward_us": round(bwd, 1),
                    "backward_tb_s": round(tokens * (2 * top_k + 1) * row_bytes / bwd / 1e6, 2),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
