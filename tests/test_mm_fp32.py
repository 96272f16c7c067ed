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


@pytest.mark.parametrize("device", ["cpu", "cuda"] if HAS_CUDA else ["cpu"])
def test_pair_gemms_match_float64(device):
    from workbench.kernels.mm_fp32 import mm_pair, mm_pair_t, split_pair

    g = torch.Generator().manual_seed(4)
    a = torch.randn(512, 64, generator=g).to(device)  # float32, as the router's upstream gradient
    b = (0.02 * torch.randn(64, 256, generator=g)).bfloat16().to(device)
    x = torch.randn(512, 256, generator=g).bfloat16().to(device)
    add = torch.randn(512, 256, generator=g).bfloat16().to(device)
    pair = split_pair(a, torch.bfloat16)
    assert pair.shape == (512, 128) and pair.dtype == torch.bfloat16
    # hi + lo carries a to ~16 significant bits (the remainder of a bf16 rounding, itself rounded)
    err_split = ((pair[:, :64].double() + pair[:, 64:].double() - a.double()).abs() / a.double().abs()).max().item()
    assert err_split < 2**-15, err_split
    ref = a.double() @ b.double()
    # the halves carry a to ~2^-17 of each element, float32 sums ~2^-24 of each product: 2^-15 of Σ|a||b| covers both
    carried = 2**-15 * (a.double().abs() @ b.double().abs())
    for addend in (None, add):
        got = mm_pair(pair, b, addend)
        want = ref if addend is None else ref + addend.double()
        assert got.dtype == torch.bfloat16
        # and one bf16 rounding of the float32 sum: 2^-8 relative per element. With an addend, cuBLAS's bias-add
        # epilogue (nvjet `badd` on the H200, benchmarks/pair_gemm_check.py) rounds the product to bf16 before it
        # adds: a second rounding, of the product, as autograd's cast and add had (CPU rounds once)
        product_rounding = 0.0 if addend is None or device == "cpu" else 2**-8 * ref.abs()
        assert ((got.double() - want).abs() <= 2**-8 * want.abs() + product_rounding + carried).all()
    got_t = mm_pair_t(pair, x)
    ref_t = a.double().t() @ x.double()
    assert got_t.dtype == torch.float32
    err_t = ((got_t.double() - ref_t).abs().max() / ref_t.abs().max()).item()
    assert err_t < 2e-5, err_t


@pytest.mark.parametrize("device", ["cpu", "cuda"] if HAS_CUDA else ["cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_router_passing_its_input_sums_both_gradients(device, dtype):
    from workbench.moe.router import router_logits, router_logits_passing

    g = torch.Generator().manual_seed(5)
    x0 = torch.randn(300, 128, generator=g).to(device, dtype)
    w0 = (0.02 * torch.randn(16, 128, generator=g)).to(device, dtype)
    d_logits = torch.randn(300, 16, generator=g).to(device)
    d_pass = torch.randn(300, 128, generator=g).to(device, dtype)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    logits, passed = router_logits_passing(x, w)
    assert torch.equal(passed, x0) and torch.equal(logits, router_logits(x0, w0))
    torch.autograd.backward((logits, passed), (d_logits, d_pass))
    x64, w64 = x0.double().requires_grad_(), w0.double().requires_grad_()
    torch.autograd.backward((x64 @ w64.t(), x64), (d_logits.double(), d_pass.double()))
    # float32: float32 sums; bf16: the weight's gradient one rounding of float32 products, the input's the rounding
    # of the sum plus, on CUDA, the rounding of the router's product before cuBLAS adds the passed gradient
    # (test_pair_gemms_match_float64): 2^-8 of each relative
    rtol = 1e-5 if dtype == torch.float32 else 2**-8
    product = (d_logits.double() @ w0.double()).abs()
    for got, ref, rounded in ((x.grad, x64.grad, product), (w.grad, w64.grad, 0.0)):
        assert got.dtype == dtype
        twice = dtype == torch.bfloat16 and device == "cuda"  # CPU rounds the input's gradient once
        bound = rtol * (ref.abs() + (rounded if twice else 0.0)) + 2e-5 * ref.abs().max().item()
        assert ((got.double() - ref).abs() <= bound).all(), ((got.double() - ref).abs() - bound).max().item()
    # only the passed input used: its gradient passes through; only the logits: the plain router's gradients
    x = x0.clone().requires_grad_()
    (router_logits_passing(x, w0)[1] * d_pass).sum().backward()
    assert torch.equal(x.grad, d_pass)
    x, x2 = x0.clone().requires_grad_(), x0.clone().requires_grad_()
    (router_logits_passing(x, w0)[0] * d_logits).sum().backward()
    (router_logits(x2, w0) * d_logits).sum().backward()
    assert torch.equal(x.grad, x2.grad)
