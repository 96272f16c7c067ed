"""The 8-bit-moment AdamW kernel beside the bf16-moment one, per expert tensor, over launch shapes (NOTES.md, AdamW).

    python benchmarks/adamw8_kernel.py > $OUT/adamw8_kernel.json

Both kernels compile to more instructions than their bytes need (sm_90 SASS: ~115 per element for bf16
moments, ~160 for 8-bit), so they are timed here on the largest tensors of the Qwen3-30B-A3B and gpt-oss-20b
architectures in the bench's mode (bf16 weights, bf16_sr, weight decay, clipping coefficient, skip flag):
milliseconds, elements per second and bytes per second (14 bytes an element for bf16 moments, 10 for 8-bit).
Also the in-backward launches (no clipping coefficient) without and with the kernels' sums of squared gradients
(the fused norm, measured 2026-12-03). A measurement tool, not a test.
"""

from __future__ import annotations

import functools
import json

import torch
import triton
from cuda_timing import cuda_event_ms

from workbench.kernels.adamw8 import quant_block, scale_shape
from workbench.kernels.adamw_args import (
    DEFAULT_LAUNCH,
    AdamWLaunch,
    AdamWStep,
    Moments8,
    SRKeys,
    adamw_scalars,
    squares_size,
)
from workbench.kernels.triton_adamw import triton_adamw_step_
from workbench.kernels.triton_adamw8 import triton_adamw8_step_

SHAPES = {"qwen3_gate_up": (128, 1536, 2048), "gpt_oss_gate_up": (32, 2880, 5760), "gpt_oss_down": (32, 2880, 2880)}
LAUNCHES = ((1024, 4), (1024, 8), (2048, 8), (2048, 4), (4096, 8), (512, 4), (512, 2))


def _ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    return cuda_event_ms(fn, reps)


def main() -> None:
    scalars = adamw_scalars(5, 1e-5, 0.9, 0.999, 1e-8, 0.01)
    keys = SRKeys.make(0, 5, 3)
    skip = torch.zeros((), device="cuda")
    coef = torch.full((), 0.5, device="cuda")
    versions = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    print(json.dumps(versions))
    for name, shape in SHAPES.items():
        n = torch.Size(shape).numel()
        p = (torch.randn(shape, device="cuda") * 0.02).bfloat16()
        g = (torch.randn(shape, device="cuda") * 1e-3).bfloat16()
        m = (torch.randn(shape, device="cuda") * 1e-4).bfloat16()
        v = (torch.rand(shape, device="cuda") * 1e-8).bfloat16()
        clipped = AdamWStep(scalars, False, skip, coef)
        full = functools.partial(triton_adamw_step_, p, g, m, v, clipped, keys)
        row = {"tensor": name, "shape": shape, "elements": n, "full_ms": round(_ms(full), 3)}
        row["full_tb_s"] = round(14 * n / row["full_ms"] / 1e9, 2)
        qb = quant_block(shape)
        codes = [torch.randint(8, 200, shape, device="cuda", dtype=torch.uint8) for _ in range(2)]
        scales = [torch.rand(scale_shape(shape, qb), device="cuda") * 1e-4 for _ in range(2)]
        state = Moments8(codes[0], scales[0], codes[1], scales[1], qb)
        row["qblock"] = qb
        row["adamw8_ms_by_launch"] = {}
        for block, warps in LAUNCHES:
            shaped = AdamWStep(scalars, False, skip, coef, AdamWLaunch(block, warps))
            step = functools.partial(triton_adamw8_step_, p, g, state, shaped, keys, True)
            row["adamw8_ms_by_launch"][f"{block}x{warps}"] = round(_ms(step), 3)
        # in-backward's launches (no clipping coefficient): without and with the kernel's sums of squares
        in_backward = AdamWStep(scalars, False, skip)
        for kind, fn in (("full", triton_adamw_step_), ("adamw8", triton_adamw8_step_)):
            block = DEFAULT_LAUNCH.block if kind == "full" else max(DEFAULT_LAUNCH.block, qb)
            sq = torch.zeros(squares_size(n, block), device="cuda")
            for label, buffer in (("no_sq", None), ("sq", sq)):
                if kind == "full":
                    call = functools.partial(fn, p, g, m, v, in_backward, keys, squares=buffer)
                else:
                    call = functools.partial(fn, p, g, state, in_backward, keys, True, squares=buffer)
                row[f"in_backward_{kind}_{label}_ms"] = round(_ms(call), 3)
        best = min(row["adamw8_ms_by_launch"].values())
        row["adamw8_default_tb_s"] = round(10 * n / row["adamw8_ms_by_launch"]["1024x4"] / 1e9, 2)
        row["adamw8_best_tb_s"] = round(10 * n / best / 1e9, 2)
        print(json.dumps(row), flush=True)
        del p, g, m, v, codes, scales, state


if __name__ == "__main__":
    main()
