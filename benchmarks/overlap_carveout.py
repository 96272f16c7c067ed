"""Can the memory-bound AdamW update run beside the compute-bound forward? A physics check on one GPU.

    python benchmarks/overlap_carveout.py --out $OUT/overlap.json

Qwen3-30B-A3B L8's step spends ~21 ms in the Triton AdamW (streaming ~78 GB) while the tensor cores idle, and
~44 ms in a forward of GEMMs, cuDNN attention and grouped GEMMs that leave bandwidth unused. Session 13 and 15
put memory-bound work on a side stream beside GEMMs and it ran only in the gaps: the GEMMs' persistent CTAs
hold every SM. Here the GEMMs leave `carveout` SMs free (torch's experimental SM carveout, which cuBLAS and
the CUTLASS grouped GEMM read) and the update runs on a low-priority stream. Printed per carveout: the
forward alone, the update alone, both together (the forward's layer i waiting for layer i's update, as a
deferred update would have it; also with equal stream priorities and without the dependencies).
A measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path
from torch.nn.attention import SDPBackend, sdpa_kernel


def make_forward(layers: int, tokens: int, device: str = "cuda"):
    """A Qwen3-30B-A3B-shaped forward of `layers` layers plus the fused CE's three lm_head GEMMs."""
    bf = dict(device=device, dtype=torch.bfloat16)
    d, heads, kv, hd, e, inter, vocab = 2048, 32, 4, 128, 128, 768, 151936
    x = torch.randn(tokens, d, **bf)
    wq, wk, wv, wo = (
        0.02 * torch.randn(a, b, **bf) for a, b in ((d, heads * hd), (d, kv * hd), (d, kv * hd), (heads * hd, d))
    )
    w_gu = 0.02 * torch.randn(e, 2 * inter, d, **bf)
    w_d = 0.02 * torch.randn(e, d, inter, **bf)
    head = 0.02 * torch.randn(vocab, d, **bf)
    counts = torch.full((e,), tokens * 8 // e, device=device)
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    rows = torch.randn(tokens * 8, d, **bf)
    batch = 2
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]

    def forward(events=None):
        h = x
        stream = torch.cuda.current_stream()
        if events is not None:
            stream.wait_event(events[0])
        for i in range(layers):
            if events is not None:
                stream.wait_event(events[i + 1])
            q = (h @ wq).view(batch, -1, heads, hd).transpose(1, 2)
            k = (h @ wk).view(batch, -1, kv, hd).transpose(1, 2)
            v = (h @ wv).view(batch, -1, kv, hd).transpose(1, 2)
            with sdpa_kernel(order, set_priority=True):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = o.transpose(1, 2).reshape(tokens, -1) @ wo
            up = torch._grouped_mm(rows, w_gu.transpose(1, 2), offs=offs)
            torch._grouped_mm(F.silu(up[:, :inter]) * up[:, inter:], w_d.transpose(1, 2), offs=offs)
        if events is not None:
            stream.wait_event(events[-1])
        logits = h @ head.t()
        logits @ head
        logits.t() @ h

    return forward


def make_update(layers: int, device: str = "cuda"):
    """The product's Triton AdamW (bf16 moments, stochastic rounding) over Qwen3-30B-A3B's parameters in the
    forward's order: the embedding, each layer (experts + attention, ~623 M), the lm_head; an event after each."""
    from workbench.kernels.adamw import SRKeys, adamw_scalars
    from workbench.kernels.triton_adamw import triton_adamw_step_

    sizes = [311_164_928] + [622_854_144] * layers + [311_164_928]
    state = [
        tuple((0.02 * torch.randn(size, device=device, dtype=torch.bfloat16)).abs() for _ in range(4)) for size in sizes
    ]
    scalars = adamw_scalars(1, 1e-5, 0.9, 0.95, 1e-8, 0.01)

    def update(events=None):
        for i, (p, g, m, v) in enumerate(state):
            triton_adamw_step_(p, g, m, v, scalars, sr=SRKeys.make(0, 1, i))
            if events is not None:
                events[i].record()

    return update


def elapsed_ms(fn, reps: int = 5) -> float:
    """Median ms of `fn()` after one warm-up call (benchmarks/cuda_timing.py's timer)."""
    fn()
    torch.cuda.synchronize()
    return cuda_event_ms(fn, reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--carveouts", default="0,8,16,24,32")
    p.add_argument("--out", default="overlap.json")
    args = p.parse_args()
    forward = make_forward(args.layers, args.tokens)
    update = make_update(args.layers)
    events = [torch.cuda.Event() for _ in range(args.layers + 2)]
    high = torch.cuda.Stream(priority=-1)
    low = torch.cuda.Stream(priority=0)
    equal = torch.cuda.Stream(priority=0)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "rows": []}
    t_update = elapsed_ms(update)
    for carveout in [int(c) for c in args.carveouts.split(",")]:
        torch._C._set_sm_carveout_experimental(carveout if carveout else None)
        t_forward = elapsed_ms(forward)

        def both(fwd_stream, dependent=True):
            main = torch.cuda.current_stream()
            low.wait_stream(main)
            fwd_stream.wait_stream(main)
            with torch.cuda.stream(low):
                update(events if dependent else None)
            with torch.cuda.stream(fwd_stream):
                forward(events if dependent else None)
            main.wait_stream(low)
            main.wait_stream(fwd_stream)

        t_both = elapsed_ms(lambda: both(high))
        t_same_priority = elapsed_ms(lambda: both(equal))
        t_independent = elapsed_ms(lambda: both(high, dependent=False))
        row = {
            "carveout_sms": carveout,
            "forward_ms": t_forward,
            "update_ms": t_update,
            "serial_ms": t_forward + t_update,
            "overlapped_ms": t_both,
            "saved_ms": t_forward + t_update - t_both,
            "overlapped_same_priority_ms": t_same_priority,
            "overlapped_no_dependencies_ms": t_independent,
        }
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    torch._C._set_sm_carveout_experimental(None)


if __name__ == "__main__":
    main()
