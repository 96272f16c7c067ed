"""Where mm_pair (the router's one-GEMM input gradient, kernels/mm_fp32.py) departs from one bf16 rounding on CUDA.

For the test's shape and the trainer's (Qwen3 at 8192 tokens: [8192, 256] x [256, 2048]), with torch's bf16
reduced-precision reduction allowed (its default) and refused: the worst error against float64 in units of the
test's bound (2^-8 |want| + the split's carry), the share of elements over it, and the cuBLAS kernels that ran.
"""

import json
import sys

import torch

from workbench.kernels.mm_fp32 import mm_pair, split_pair


def check(m: int, k: int, n: int, reduced: bool, seed: int = 4) -> dict:
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = reduced
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g).cuda()
    b = (0.02 * torch.randn(k, n, generator=g)).bfloat16().cuda()
    add = torch.randn(m, n, generator=g).bfloat16().cuda()
    pair = split_pair(a, torch.bfloat16)
    ref = a.double() @ b.double()
    carried = 2**-15 * (a.double().abs() @ b.double().abs())
    out = {}
    for name, addend in (("mm", None), ("addmm", add)):
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got = mm_pair(pair, b, addend)
            torch.cuda.synchronize()
        want = ref if addend is None else ref + addend.double()
        ratio = (got.double() - want).abs() / (2**-8 * want.abs() + carried)
        worst = int(ratio.argmax())
        out[name] = {
            "worst_ratio": ratio.max().item(),
            "share_over": (ratio > 1).double().mean().item(),
            "worst_want": want.flatten()[worst].item(),
            "worst_got": got.double().flatten()[worst].item(),
            "kernels": sorted({e.name[:120] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA}),
        }
    return out


if __name__ == "__main__":
    results = {}
    for m, k, n in ((512, 64, 256), (8192, 128, 2048)):
        for reduced in (True, False):
            results[f"{m}x{2 * k}x{n} reduced={reduced}"] = check(m, k, n, reduced)
    text = json.dumps(results, indent=1)
    print(text)
    if len(sys.argv) > 1:
        open(sys.argv[1], "w").write(text)
