"""The fused linear cross-entropy's chunk size on a GPU: time of forward + backward and peak memory above inputs.

    python benchmarks/ce_chunks.py [--tokens 8192 16384] [--vocab 163840 151936]

One line of JSON per (tokens, vocab, chunk): the lm_head of hidden 2048 in bf16, the Triton CE kernel (the engine's
default on CUDA), CUDA-event medians of 10 after 3 warm-up calls. Chunks of the whole token count take the one-chunk
path (the weight gradient straight in bf16, no float32 buffer).
"""

from __future__ import annotations

import argparse
import json

import torch
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path

from workbench.kernels.cross_entropy import chunk_bounds, default_chunk_size, fused_linear_cross_entropy


def measure(tokens: int, vocab: int, chunk: int, hidden: int = 2048) -> dict:
    """Median ms and peak GiB above the inputs of one fused CE forward + backward."""
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(tokens, hidden, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)

    def step() -> None:
        h.grad = w.grad = None
        fused_linear_cross_entropy(h, w, y, chunk_size=chunk, use_triton=True).backward()

    for _ in range(3):
        step()
    h.grad = w.grad = None  # the base holds the inputs only, as each timed call starts
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = cuda_event_ms(step, 10)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return {
        "tokens": tokens,
        "vocab": vocab,
        "chunk": chunk,
        "chunks": len(chunk_bounds(tokens, chunk)),
        "ms": round(ms, 3),
        "peak_gib": round(peak, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--vocab", type=int, nargs="+", default=[163840, 151936])
    args = p.parse_args()
    for tokens in args.tokens:
        for vocab in args.vocab:
            small = default_chunk_size(tokens, vocab, 2048, 2)  # the frozen-head budget (the default until 2026-12-02)
            default = default_chunk_size(tokens, vocab, 2048, 2, weight_grad=True)
            for chunk in sorted({small, 2 * small, tokens // 3 + 1, tokens // 2, tokens, default}):
                print(json.dumps({**measure(tokens, vocab, chunk), "default": chunk == default}), flush=True)


if __name__ == "__main__":
    main()
