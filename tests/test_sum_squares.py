"""The clipping norm's Triton sum of squares (kernels/triton_sum_squares.py) against a float64 reference.

Large bf16 and float32 tensors (the kernel, with ragged tails), small and non-contiguous ones (torch's
`_foreach_norm`), and the trainer's total_grad_norm on a model's grads; the same value on a second call.
Triton's interpreter on CPU, the compiled kernel where a CUDA GPU is present (a subprocess, so
TRITON_INTERPRET applies before triton is imported).
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from triton_script import DEVICES, run_triton_script

_SCRIPT = textwrap.dedent("""
    import sys, torch
    from workbench.kernels.triton_sum_squares import MIN_NUMEL, sum_of_squares, takes
    from workbench.train.optim import total_grad_norm
    device = sys.argv[1]
    g = torch.Generator().manual_seed(4)
    big_bf16 = (3 * torch.randn(MIN_NUMEL + 12345, generator=g)).to(torch.bfloat16).to(device)
    big_fp32 = torch.randn(1, MIN_NUMEL + 7, generator=g).to(device)
    small = torch.randn(37, generator=g).to(torch.bfloat16).to(device)
    strided = torch.randn(64, MIN_NUMEL // 32, generator=g).to(device).t()  # large but not contiguous
    tensors = [big_bf16, small, big_fp32, strided]
    assert [takes(t) for t in tensors] == [True, False, True, False]
    ref = sum(t.double().square().sum() for t in tensors)
    got = sum_of_squares(tensors)
    assert got.dtype == torch.float32 and got.device.type == device
    assert abs(got.double() - ref) / ref < 1e-5, (float(got), float(ref))
    assert torch.equal(sum_of_squares(tensors), got)  # a fixed reduction order
    assert abs(sum_of_squares([small]).double() - small.double().square().sum()) < 1e-4
    # the trainer's norm: parameters' grads through the same path
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in tensors]
    for p, t in zip(params, tensors):
        p.grad = t.clone()
    norm = total_grad_norm(params)
    assert abs(norm.double() - ref.sqrt()) / ref.sqrt() < 1e-5, (float(norm), float(ref.sqrt()))
    print("SUM SQUARES OK")
""")


@pytest.mark.parametrize("device", DEVICES)
def test_sum_of_squares_matches_float64(device):
    run_triton_script(_SCRIPT, device, "SUM SQUARES OK")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (it ships ptxas)")
def test_sum_squares_kernel_issues_all_its_loads_at_once():
    # A program's ITERS blocks are loaded in one unrolled sequence: as a loop, each thread had 32 bytes in flight
    # and the H200 profile read the gradients at 1.8 TB/s (benchmarks/NOTES.md, session 15). Compiled for sm_90.
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_sum_squares import BLOCK, ITERS, _sum_squares_kernel

    types = {"X": "*bf16", "PARTIAL": "*fp32", "numel": "i64", "first": "i64"}
    kernel = compile_for_h200(_sum_squares_kernel, types, dict(BLOCK=BLOCK, ITERS=ITERS), ("X", "PARTIAL", "numel"), 8)
    ptx = kernel.asm["ptx"]
    assert "bra" not in ptx.split("ld.global", 1)[1]  # no loop: nothing branches back between the loads
    per_thread = BLOCK * ITERS // (8 * 32) * 2  # bytes each of the 256 threads loads
    assert ptx.count("ld.global.v4.b32") == per_thread // 16
