"""mm_fp32: float32 products of bf16 operands on tensor cores, and the router/CE paths that use it."""

from __future__ import annotations

import pytest
import torch

from workbench.kernels.mm_fp32 import mm_fp32, tensor_core_path

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="the out_dtype GEMMs run on CUDA only")


def _reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.double() @ b.double()


def test_cpu_runs_the_float32_matmul_with_out_and_accumulate():
    g = torch.Generator().manual_seed(1)
    a = torch.randn(37, 64, generator=g).bfloat16()
    b = torch.randn(64, 19, generator=g)
    assert not tensor_core_path(a, b)
    expected = a.float() @ b
    torch.testing.assert_close(mm_fp32(a, b), expected, rtol=0, atol=0)
    out = torch.randn(37, 19, generator=g)
    start = out.clone()
    mm_fp32(a, b, out=out, accumulate=True)
    torch.testing.assert_close(out, start + expected, rtol=1e-6, atol=1e-5)
    mm_fp32(a, b, out=out)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="needs an out tensor"):
        mm_fp32(a, b, accumulate=True)


@needs_cuda
@pytest.mark.parametrize(
    "a_dtype,b_dtype",
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)],
)
def test_cuda_tensor_cores_match_float64(a_dtype, b_dtype):
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(4096, 2048, device="cuda", generator=g).to(a_dtype)
    b = torch.randn(2048, 128, device="cuda", generator=g).to(b_dtype)
    assert tensor_core_path(a, b)
    ref = _reference(a, b)
    got = mm_fp32(a, b)
    assert got.dtype == torch.float32
    # float32 sums over 2048 products; a float32 operand is carried to 16 bits (hi + lo)
    err = ((got.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-5, err
    out = torch.randn(4096, 128, device="cuda", generator=g)
    start = out.clone()
    mm_fp32(a, b, out=out, accumulate=True)
    err_acc = ((out.double() - (start.double() + ref)).abs().max() / ref.abs().max()).item()
    assert err_acc < 2e-5, err_acc


@needs_cuda
def test_cuda_router_logits_and_grads_match_float64():
    from workbench.moe.router import router_logits

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(2048, 512, device="cuda", generator=g).bfloat16().requires_grad_()
    w = (0.02 * torch.randn(64, 512, device="cuda", generator=g)).bfloat16().requires_grad_()
    upstream = torch.randn(2048, 64, device="cuda", generator=g)
    logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    logits.backward(upstream)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = x64 @ w64.t()
    ref.backward(upstream.double())
    torch.testing.assert_close(logits.double(), ref, rtol=1e-5, atol=1e-5)
    # bf16 gradients: one bf16 rounding (2^-8 relative) of a float32 result whose error is
    # ~2^-17 of the largest summands (the upstream float32 gradient carried as bf16 hi + lo)
    for got, ref in ((x.grad, x64.grad), (w.grad, w64.grad)):
        torch.testing.assert_close(got.double(), ref, rtol=8e-3, atol=2e-5 * ref.abs().max().item())
