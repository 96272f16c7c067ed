"""The clipping norm's Triton sum of squares (kernels/triton_sum_squares.py) against a float64 reference.

Large bf16 and float32 tensors (the kernel, with ragged tails), small and non-contiguous ones (torch's
`_foreach_norm`), and the trainer's total_grad_norm on a model's grads; the same value on a second call.
Triton's interpreter on CPU, the compiled kernel where a CUDA GPU is present (a subprocess, so
TRITON_INTERPRET applies before triton is imported).
"""

from __future__ import annotations

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
