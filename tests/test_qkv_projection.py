"""The q/k/v projections as one autograd node (models/qkv_projection.py) against Transformers' three linears."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from workbench.models.qkv_projection import fusable, qkv_projection


def _layers(dtype, bias=False, seed=0):
    torch.manual_seed(seed)
    return [nn.Linear(64, width, bias=bias).to(dtype) for width in (96, 32, 32)]


def _run(fn, x, layers, grads):
    x = x.clone().requires_grad_()
    outs = fn(x, *layers)
    torch.autograd.backward(outs, grads)
    return outs, x.grad, [p.weight.grad for p in layers]


def _three_linears(x, q, k, v):
    return q(x), k(x), v(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_gradients_equal_three_linears(dtype):
    layers = _layers(dtype)
    x = torch.randn(2, 7, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    grads = [
        torch.randn(2, 7, p.out_features, generator=torch.Generator().manual_seed(i)).to(dtype)
        for i, p in enumerate(layers)
    ]
    want_out, want_dx, want_dw = _run(_three_linears, x, layers, grads)
    for p in layers:
        p.weight.grad = None
    got_out, got_dx, got_dw = _run(qkv_projection, x, layers, grads)
    for a, b in zip(got_out, want_out, strict=True):
        assert torch.equal(a, b)  # the forward is the same three products
    for a, b in zip(got_dw, want_dw, strict=True):
        assert torch.equal(a, b)  # so are the weight gradients
    # the input's gradient against the exact sum: the GEMM's accumulation rounds no more than autograd's adds
    exact = sum(g.float().reshape(14, -1) @ p.weight.float() for g, p in zip(grads, layers, strict=True))
    exact = exact.view(2, 7, 64)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got_dx.float(), exact, **tol)
    assert (got_dx.float() - exact).abs().mean() <= 1.1 * (want_dx.float() - exact).abs().mean() + 1e-7


def test_one_node_takes_the_three_gradients_and_sums_them_in_the_gemms():
    layers = _layers(torch.float32)
    x = torch.randn(4, 64).requires_grad_()
    outs = qkv_projection(x, *layers)
    node = outs[0].grad_fn
    assert "QKVProjection" in type(node).__name__ and all(o.grad_fn is node for o in outs)
    loss = sum(o.sum() for o in outs)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    ops = {e.key: e.count for e in prof.key_averages()}
    assert ops.get("aten::addmm_", 0) == 2, ops  # dk Wk and dv Wv added to dq Wq by the GEMM


def test_only_plain_bias_free_linears_of_one_dtype_fuse():
    assert fusable(*_layers(torch.float32))
    assert not fusable(*_layers(torch.float32, bias=True))
    q, k, v = _layers(torch.float32)
    assert not fusable(q, k.to(torch.bfloat16), v)

    class Wrapped(nn.Linear):  # a LoRA or TE layer is another class: its own forward runs
        pass

    assert not fusable(Wrapped(64, 96, bias=False), k, v)
    x = torch.randn(3, 64, requires_grad=True)
    biased = _layers(torch.float32, bias=True)
    outs = qkv_projection(x, *biased)
    for o, p in zip(outs, biased, strict=True):
        torch.testing.assert_close(o, p(x))
        assert "QKVProjection" not in type(o.grad_fn).__name__
    with torch.no_grad():
        outs = qkv_projection(x, *_layers(torch.float32))
    assert all(o.grad_fn is None for o in outs)
