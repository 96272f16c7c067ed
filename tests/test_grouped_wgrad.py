"""The experts' weight gradient with its sum of squares (kernels/grouped_wgrad.py, moe/expert_wgrad.py,
kernels/grad_squares.py): against float64 and against autograd of torch's grouped GEMM, and the clipping norm that
takes the squares only while they describe .grad."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
from triton_script import DEVICES, run_triton_script

from workbench.kernels import grad_squares
from workbench.kernels.grouped_wgrad import grouped_wgrad_torch
from workbench.train.optim import total_grad_norm

# Shape suffixes: T rows, E experts, M and N the gradient's two dims.

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton: its interpreter runs on CPU)"
)


def _reference(a_TM: torch.Tensor, b_TN: torch.Tensor, counts: list[int]) -> torch.Tensor:
    out, start = [], 0
    for c in counts:
        out.append(a_TM[start : start + c].double().t() @ b_TN[start : start + c].double())
        start += c
    return torch.stack(out)


def test_torch_reference_and_its_squares():
    g = torch.Generator().manual_seed(0)
    counts = [5, 0, 17, 9]
    a = torch.randn(sum(counts), 12, generator=g).bfloat16()
    b = torch.randn(sum(counts), 20, generator=g).bfloat16()
    out, squares = grouped_wgrad_torch(a, b, torch.tensor(counts).cumsum(0).to(torch.int32))
    ref = _reference(a, b, counts)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 12, 20)
    assert ((out.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-6).all()
    assert torch.equal(out[1], torch.zeros(12, 20, dtype=torch.bfloat16))
    torch.testing.assert_close(squares, out.float().square().sum(dim=(1, 2)), rtol=1e-6, atol=0)


def test_squares_describe_the_gradient_only_while_it_is_unchanged():
    w = torch.nn.Parameter(torch.randn(3, 4))
    grad = torch.randn(3, 4)
    partials = torch.stack([grad[:2].square().sum(), grad[2:].square().sum()])
    grad_squares.record(w, grad, partials)
    w.grad = grad  # what autograd does with a gradient it can take as it is
    assert torch.equal(grad_squares.take(w), partials.sum())
    assert grad_squares.take(w) is None  # one backward's sums serve one norm
    # changed in place (a reduction, a scaling), accumulated into another tensor, or replaced: the norm reads .grad
    for change in ("in_place", "other_tensor", "no_grad"):
        grad = torch.randn(3, 4)
        grad_squares.record(w, grad, grad.square().sum().reshape(1))
        if change == "in_place":
            w.grad = grad
            grad.mul_(2.0)
        elif change == "other_tensor":
            w.grad = grad.clone()
        else:
            w.grad = None
        assert grad_squares.take(w) is None, change
        assert not hasattr(w, grad_squares.ATTR)
    # the norm: recorded squares stand in for their gradient, the others are read
    a, b = torch.nn.Parameter(torch.randn(5)), torch.nn.Parameter(torch.randn(7))
    a.grad, b.grad = torch.randn(5), torch.randn(7)
    grad_squares.record(a, a.grad, torch.tensor([100.0]))  # a wrong sum, to see that it is the one used
    assert torch.allclose(total_grad_norm([a, b]), (100.0 + b.grad.square().sum()).sqrt())
    assert torch.allclose(total_grad_norm([a, b]), torch.cat([a.grad, b.grad]).norm())  # taken once


_KERNEL_SCRIPT = textwrap.dedent("""
import sys, torch
from workbench.kernels.triton_grouped_wgrad import blocks_for, grouped_wgrad

device = sys.argv[1]
g = torch.Generator().manual_seed(1)
# ragged rows (an empty expert, counts off the row block), the layer's two gradient shapes, scaled down
for m, n, counts in ((32, 64, [7, 0, 40, 16, 33]), (64, 32, [64, 1, 0, 70]), (256, 512, [130, 3, 64])):
    a = torch.randn(sum(counts), m, generator=g).bfloat16().to(device)
    b = torch.randn(sum(counts), n, generator=g).bfloat16().to(device)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
    ref, start = [], 0
    for c in counts:
        ref.append(a[start : start + c].double().t() @ b[start : start + c].double())
        start += c
    ref = torch.stack(ref)
    for tma_store in (False, True):
        out, squares = grouped_wgrad(a, b, offsets, tma_store=tma_store)
        assert out.shape == (len(counts), m, n) and out.dtype == torch.bfloat16
        # float32 sums of exact products, one bf16 rounding (the interpreter truncates: up to one bf16 step)
        bad = (out.double() - ref).abs() > 2**-7 * ref.abs() + 1e-3
        assert not bad.any(), (m, n, tma_store, (out.double() - ref).abs().max().item())
        assert squares.numel() == len(counts) * (m // blocks_for(m, n)[0]) * (n // blocks_for(m, n)[1])
        want = out.float().square().sum()
        assert abs(squares.sum().item() - want.item()) <= 1e-5 * want.item(), (squares.sum(), want)
# the autograd node, both weight layouts ([E, O, K] as Qwen3's, [E, K, O] as GPT-OSS's), against torch's grouped GEMM
from workbench.moe.expert_wgrad import grouped_linear_wgrad

counts = [9, 0, 33, 20]
offsets = torch.tensor(counts).cumsum(0).to(torch.int32).to(device)
x0 = torch.randn(sum(counts), 32, generator=g).bfloat16().to(device)
dy = torch.randn(sum(counts), 48, generator=g).bfloat16().to(device)
for transposed in (False, True):
    w0 = (0.1 * torch.randn(4, *((32, 48) if transposed else (48, 32)), generator=g)).bfloat16().to(device)
    x, w = x0.clone().requires_grad_(), torch.nn.Parameter(w0.clone())
    y = grouped_linear_wgrad(x, w, offsets, transposed)
    y.backward(dy)
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    yr = torch._grouped_mm(xr, wr if transposed else wr.transpose(-2, -1), offs=offsets)
    yr.backward(dy)
    assert torch.equal(y, yr), transposed  # the forward is torch's own GEMM
    for got, want in ((x.grad, xr.grad), (w.grad, wr.grad)):
        err = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert err < 1e-2 and got.shape == want.shape, (transposed, err)
print("GROUPED WGRAD OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_triton_kernel_matches_float64_with_its_squares(device):
    run_triton_script(_KERNEL_SCRIPT, device, "GROUPED WGRAD OK")


_MODEL_SCRIPT = textwrap.dedent("""
import sys, torch
sys.path.insert(0, "tests")
from tiny_models import tiny_qwen3_moe
import workbench
from workbench.kernels import grad_squares
from workbench.train.optim import total_grad_norm

device = sys.argv[1]
cfg = tiny_qwen3_moe(hidden_size=64, moe_intermediate_size=32, head_dim=16)
models = {}
for wgrad in ("autograd", "triton"):
    backend = workbench.BackendConfig(experts="grouped_mm", expert_wgrad=wgrad)
    models[wgrad] = workbench.AutoModelForCausalLM.from_config(cfg, backend=backend, device=device,
                                                                dtype=torch.bfloat16, seed=0)
models["triton"].load_state_dict(models["autograd"].state_dict())
ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)).to(device)
for model in models.values():
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
experts = [n for n, _ in models["triton"].named_parameters() if ".experts." in n]
assert len(experts) == 2 * cfg.num_hidden_layers, experts
ref = dict(models["autograd"].named_parameters())
for name, p in models["triton"].named_parameters():
    r = ref[name].grad.float()
    err = ((p.grad.float() - r).norm() / r.norm()).item()
    # the experts' gradients summed in another order (bf16 results), everything else the same computation
    assert err < (1e-2 if name in experts else 1e-6), (name, err)
    assert hasattr(p, grad_squares.ATTR) == (name in experts), name
    if name in experts:  # autograd took the kernel's tensor as .grad (a copy would leave the squares unused)
        assert getattr(p, grad_squares.ATTR).ptr == p.grad.data_ptr(), name
params = list(models["triton"].parameters())
want = torch.cat([p.grad.float().flatten() for p in params]).norm()
got = total_grad_norm(params)
assert abs(got.item() - want.item()) <= 1e-4 * want.item(), (got, want)
assert not any(hasattr(p, grad_squares.ATTR) for p in params)  # the norm took every record
print("EXPERT WGRAD MODEL OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_engine_experts_weight_gradient_and_the_norm_that_takes_its_squares(device):
    run_triton_script(_MODEL_SCRIPT, device, "EXPERT WGRAD MODEL OK")


@needs_triton
@pytest.mark.parametrize("inter,warned", [(32, False), (20, True)])
def test_install_says_which_weights_keep_autograds_gradient(inter, warned):
    import warnings

    from tiny_models import tiny_qwen3_moe
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    from workbench.moe.dispatch.local import LocalDispatcher
    from workbench.moe.hf_experts import install_engine_experts

    cfg = tiny_qwen3_moe(hidden_size=64, moe_intermediate_size=inter)
    module = hf.Qwen3MoeExperts(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        install_engine_experts(module, LocalDispatcher(8, "torch"), "grouped_mm", (0, 8), 8, wgrad="triton")
    said = [str(w.message) for w in caught if "expert_wgrad" in str(w.message)]
    assert bool(said) == warned, said
    if warned:  # gate_up [40, 64] and down [64, 20]: neither tiles
        assert any("gate_up_proj" in m for m in said) and any("down_proj" in m for m in said), said
    with pytest.raises(ValueError, match="expert_wgrad"):
        install_engine_experts(hf.Qwen3MoeExperts(cfg), LocalDispatcher(8, "torch"), "grouped_mm", (0, 8), 8, wgrad="x")
