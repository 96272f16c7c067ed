"""The experts' weight gradients of one Qwen3-30B-A3B MoE layer: torch's grouped GEMM plus the clipping norm's read of
its output, against the Triton kernel that sums the squares as it stores (kernels/triton_grouped_wgrad.py), per launch
choice.

    python benchmarks/grouped_wgrad.py --out $OUT/grouped_wgrad.json

Why: the trainer's clipping norm reads every expert gradient again (1.2 GB a layer, ~0.3 ms at ~4 TB/s); the Triton
kernel removes that read if its GEMM is within ~0.3 ms a layer of CUTLASS's (grouped_mm_tune.py on 2026-12-04 had
Inductor's Triton template 5-9% behind CUTLASS on these two shapes). A measurement tool, not a test.
"""

from __future__ import annotations

import argparse

import torch
from cuda_timing import cuda_event_ms  # benchmarks/ is this script's folder, first on sys.path
from grouped_mm_tune import layer_arguments, routed_rows, save_row

# Launch choices of grouped_wgrad tried (its keyword arguments; blocks: BM, BN, BK, warps).
CHOICES = (
    {},
    {"stages": 3},
    {"tma_store": True},
    {"flatten": True},
    {"tma_store": True, "flatten": True},
    {"warp_specialize": True},
    {"stages": 3, "blocks": (128, 256, 64, 4)},
    {"blocks": (128, 128, 64, 4)},
    {"blocks": (128, 128, 64, 8)},
    {"stages": 3, "blocks": (256, 128, 64, 8)},
)


def main() -> None:
    from workbench.kernels.triton_grouped_wgrad import grouped_wgrad
    from workbench.kernels.triton_sum_squares import sum_of_squares

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    layer_arguments(p, reps=30)
    p.add_argument("--out", default="grouped_wgrad.json")
    args = p.parse_args()
    offs, result = routed_rows(args)
    rows = int(offs[-1])
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, args.hidden, **bf)
    h = torch.randn(rows, args.inter, **bf)
    problems = {  # (dy [T, O], rows in [T, K]): the weight [E, O, K]'s gradient dy_e^T x_e, as the engine's node
        "dw_gate_up": (torch.randn(rows, 2 * args.inter, **bf), x),
        "dw_down": (torch.randn(rows, args.hidden, **bf), h),
    }
    for name, (dy, rows_in) in problems.items():
        flops = 2 * rows * dy.shape[1] * rows_in.shape[1]

        def aten(dy=dy, rows_in=rows_in):
            return torch._grouped_mm(dy.t(), rows_in, offs=offs)

        ref = aten()
        row = {
            "aten_ms": cuda_event_ms(aten, args.reps),
            "aten_plus_norm_read_ms": cuda_event_ms(lambda aten=aten: sum_of_squares([aten()]), args.reps),
            "norm_read_ms": cuda_event_ms(lambda ref=ref: sum_of_squares([ref]), args.reps),
        }
        row["aten_tflops"] = flops / row["aten_ms"] / 1e9
        ref_sq = ref.float().square().sum().item()
        for choice in CHOICES:
            key = "triton" + "".join(f"_{k}={v}" for k, v in choice.items()).replace(" ", "")
            try:

                def run(dy=dy, rows_in=rows_in, choice=choice):
                    return grouped_wgrad(dy, rows_in, offs, **choice)

                out, squares = run()
                row[key] = {
                    "ms": cuda_event_ms(run, args.reps),
                    "max_abs_diff": (out.float() - ref.float()).abs().max().item(),
                    "squares_rel_diff": abs(squares.sum().item() - ref_sq) / ref_sq,
                }
                row[key]["tflops"] = flops / row[key]["ms"] / 1e9
            except Exception as err:  # a launch choice this Triton cannot compile: say so, try the next
                row[key] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
        timed = {k: v["ms"] for k, v in row.items() if isinstance(v, dict) and "ms" in v}
        if timed:  # what the trainer would gain a layer: CUTLASS plus the norm's read against the best choice
            best = min(timed, key=timed.get)
            row["best"] = {"choice": best, "ms": timed[best], "saved_ms": row["aten_plus_norm_read_ms"] - timed[best]}
        save_row(result, name, row, args.out)


if __name__ == "__main__":
    main()
