"""The six grouped GEMMs of one Qwen3-30B-A3B MoE layer (forward, input and weight gradients), ATen's CUTLASS
kernel against Inductor's autotuned Triton template, at the bench's shapes and a random router's expert counts.

    python benchmarks/grouped_mm_tune.py --out $OUT/grouped_mm.json

Why: the profile of Qwen3 L8's step (2026-12-04) puts the weight-gradient GEMMs at ~420-470 TFLOP/s against
~550-600 for the others; ATen picks one of two CUTLASS tiles by the average rows per expert. A measurement
tool, not a test.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path


def expert_counts(tokens: int, hidden: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    """Rows per expert from a randomly initialized router on random hidden states (the bench's routing)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=g)
    w = 0.02 * torch.randn(experts, hidden, device="cuda", generator=g)
    ids = torch.topk(torch.softmax(x @ w.t(), dim=-1), top_k, dim=-1).indices
    return torch.bincount(ids.reshape(-1), minlength=experts)


def problems(rows: int, hidden: int, inter2: int, inter: int, experts: int) -> dict:
    """name -> (a, b) as autograd of the engine's experts hands them to grouped_mm (same strides)."""
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, hidden, **bf)
    w_gu = 0.02 * torch.randn(experts, inter2, hidden, **bf)
    dh = torch.randn(rows, inter2, **bf)
    h = torch.randn(rows, inter, **bf)
    w_d = 0.02 * torch.randn(experts, hidden, inter, **bf)
    dy = torch.randn(rows, hidden, **bf)
    return {
        "fwd_gate_up": (x, w_gu.transpose(1, 2)),
        "dx_gate_up": (dh, w_gu),
        "dw_gate_up": (dh.t(), x),
        "fwd_down": (h, w_d.transpose(1, 2)),
        "dx_down": (dy, w_d),
        "dw_down": (dy.t(), h),
    }


def time_ms(fn, reps: int) -> float:
    """Median ms of `fn()` after three warm-up calls (benchmarks/cuda_timing.py's timer)."""
    for _ in range(3):
        fn()
    return cuda_event_ms(fn, reps)


def layer_arguments(p: argparse.ArgumentParser, reps: int) -> None:
    """The MoE layer's shape (Qwen3-30B-A3B's by default) and the timed repetitions, for the GEMM scripts here."""
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--inter", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--reps", type=int, default=reps)


def routed_rows(args) -> tuple[torch.Tensor, dict]:
    """The int32 end offsets of a random router's rows per expert at the layer's shape, and a results dict for them."""
    counts = expert_counts(args.tokens, args.hidden, args.experts, args.top_k)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "counts_min_max_mean": [int(counts.min()), int(counts.max()), float(counts.float().mean())],
        "rows": {},
    }
    return torch.cumsum(counts, 0, dtype=torch.int32), result


def save_row(result: dict, name: str, row: dict, path: str) -> None:
    """One problem's row into `result`, printed, and the whole written to `path` (a cut run keeps what it measured)."""
    result["rows"][name] = row
    print(name, json.dumps(row), flush=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(p, reps=20)
    p.add_argument("--only", default="", help="comma-separated problem names (default: all six)")
    p.add_argument("--out", default="grouped_mm.json")
    args = p.parse_args()
    import torch._inductor.config as inductor_config

    inductor_config.max_autotune_gemm_backends = "ATEN,TRITON"
    offs, result = routed_rows(args)
    rows = int(offs[-1])
    probs = problems(rows, args.hidden, 2 * args.inter, args.inter, args.experts)
    wanted = [n for n in args.only.split(",") if n] or list(probs)
    for name in wanted:
        a, b = probs[name]
        flops = 2 * a.shape[0] * a.shape[1] * b.shape[-1]

        def aten(a=a, b=b):
            return torch._grouped_mm(a, b, offs=offs)

        ref = aten()
        t_aten = time_ms(aten, args.reps)
        torch._dynamo.reset()
        compiled = torch.compile(aten, mode="max-autotune-no-cudagraphs", dynamic=False)
        t0 = time.perf_counter()
        got = compiled()
        compile_s = time.perf_counter() - t0
        err = (got.float() - ref.float()).abs().max().item()
        t_tuned = time_ms(compiled, args.reps)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            compiled()
            torch.cuda.synchronize()
        kernels = sorted({e.name[:120] for e in prof.events() if e.device_type.name == "CUDA"})
        row = {
            "a": [list(a.shape), list(a.stride())],
            "b": [list(b.shape), list(b.stride())],
            "aten_ms": t_aten,
            "aten_tflops": flops / t_aten / 1e9,
            "autotuned_ms": t_tuned,
            "autotuned_tflops": flops / t_tuned / 1e9,
            "compile_s": compile_s,
            "max_abs_diff": err,
            "autotuned_kernels": kernels,
        }
        save_row(result, name, row, args.out)


if __name__ == "__main__":
    main()
