"""Why the Triton AdamW streams slower over the model than over one tensor (benchmarks/NOTES.md, AdamW).

    python benchmarks/adamw_sweep.py --layers 8 --out $OUT/adamw-sweep.json

The parameter shapes of the Qwen3-30B-A3B architecture at --layers (bf16, as the engine trains
them) are laid out as views of four flat buffers (param, grad, exp_avg, exp_avg_sq), so the same
bytes can be updated per tensor (what TritonAdamW does) or in one launch over the flat buffers (the
bandwidth ceiling of this kernel). Block size and warps are swept; torch's fused AdamW is the
reference. TB/s counts 14 bytes per element. A measurement tool, not a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import triton
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path


def cuda_ms(fn, reps: int = 7) -> float:
    """Median milliseconds of `fn()` after one warm-up call (the first launch compiles the kernel)."""
    fn()
    return cuda_event_ms(fn, reps)


def model_shapes(layers: int) -> list[tuple[int, ...]]:
    """Parameter shapes of the engine model at `layers` (built on the meta device)."""
    import workbench
    from workbench.config import preset_config

    config = preset_config("qwen3-30b-a3b", layers)
    with torch.device("meta"):
        model = workbench.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    return [tuple(p.shape) for p in model.parameters()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", default="adamw-sweep.json")
    args = ap.parse_args()

    from workbench.kernels.adamw_args import AdamWLaunch, AdamWStep, adamw_scalars
    from workbench.kernels.triton_adamw import triton_adamw_step_

    shapes = model_shapes(args.layers)
    sizes = [int(torch.Size(s).numel()) for s in shapes]
    total = sum(sizes)
    flat = [torch.empty(total, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    for f in flat:
        f.normal_(0, 0.02)
    flat[3].abs_()  # exp_avg_sq >= 0
    views, start = [], 0
    for n in sizes:
        views.append(tuple(f[start : start + n] for f in flat))
        start += n
    s = adamw_scalars(3, 1e-5, 0.9, 0.999, 1e-8, 0.01)

    def launch(tensors, block, warps):
        # the product's launcher (argument checks, flags) with this block and warps
        triton_adamw_step_(*tensors, AdamWStep(s, launch=AdamWLaunch(block, warps)))

    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": args.layers,
        "tensors": len(sizes),
        "elements": total,
        "runs": [],
    }
    gb = 14 * total / 1e9
    biggest = max(range(len(sizes)), key=lambda i: sizes[i])
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            if block // (32 * warps) < 4:
                continue
            per_tensor = cuda_ms(lambda block=block, warps=warps: [launch(t, block, warps) for t in views])
            one = cuda_ms(lambda block=block, warps=warps: launch(tuple(flat), block, warps))
            big = cuda_ms(lambda block=block, warps=warps: launch(views[biggest], block, warps))
            row = {
                "block": block,
                "warps": warps,
                "per_tensor_ms": per_tensor,
                "per_tensor_tb_s": gb / per_tensor,
                "flat_ms": one,
                "flat_tb_s": gb / one,
                "biggest_numel": sizes[biggest],
                "biggest_tb_s": 14 * sizes[biggest] / 1e9 / big,
            }
            result["runs"].append(row)
            print(json.dumps(row), flush=True)
    # torch's fused AdamW over the same tensors (its own state, so a separate allocation per step is avoided)
    params = [torch.nn.Parameter(v[0]) for v in views]
    for prm, v in zip(params, views):
        prm.grad = v[1]
    opt = torch.optim.AdamW(params, lr=1e-5, fused=True)
    opt.step()
    ms = cuda_ms(opt.step)
    result["torch_fused"] = {"ms": ms, "tb_s": gb / ms}
    print("torch fused", json.dumps(result["torch_fused"]), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
