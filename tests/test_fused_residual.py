"""The residual stream's adds folded into the kernels around them (kernels/rms_norm.rms_norm_residual,
models/engine_attention.o_proj_residual, models/families/qwen3_moe/decoder.py), against Transformers' separate adds."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
from torch import nn
from triton_script import DEVICES, run_triton_script

from workbench.kernels.rms_norm import rms_norm, rms_norm_residual
from workbench.models.engine_attention import o_proj_residual

# Shape suffixes: T tokens, D hidden, N routed rows.

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAS_TRITON, reason="triton is not installed (pip install triton: its interpreter runs on CPU)"
)


def test_torch_backend_is_the_norm_and_the_input_itself():
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.randn(16)
    y, res = rms_norm_residual(x, w, 1e-6, "torch")
    assert res is x
    torch.testing.assert_close(y, rms_norm(x, w, 1e-6, "torch"), rtol=0, atol=0)


def test_o_proj_adds_the_residual_in_the_gemm_with_the_same_gradients():
    torch.manual_seed(0)
    proj = nn.Linear(24, 16, bias=False)
    out = torch.randn(2, 5, 24, requires_grad=True)
    residual = torch.randn(2, 5, 16, requires_grad=True)
    upstream = torch.randn(2, 5, 16)
    got = o_proj_residual(proj, out, residual)
    assert "Addmm" in type(got.grad_fn).__name__ or "View" in type(got.grad_fn).__name__
    grads = torch.autograd.grad(got, (out, residual, proj.weight), upstream)
    want = residual + proj(out)
    want_grads = torch.autograd.grad(want, (out, residual, proj.weight), upstream)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    # a biased or wrapped projection takes the plain add
    biased = nn.Linear(24, 16)
    torch.testing.assert_close(o_proj_residual(biased, out, residual), residual + biased(out))
    assert o_proj_residual(proj, out, None) is not None


_SCRIPT = textwrap.dedent("""
import sys, torch
from workbench.kernels.rms_norm import rms_norm, rms_norm_residual

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
    for shape in ((3, 7, 64), (37, 2048)):
        x0 = torch.randn(*shape, generator=g).to(dtype).to(device)
        w0 = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(device)
        dy = torch.randn(*shape, generator=g).to(dtype).to(device)
        dres = torch.randn(*shape, generator=g).to(dtype).to(device)
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y, res = rms_norm_residual(x, w, 1e-6, "triton")
        torch.autograd.backward((y, res), (dy, dres))
        # the reference: Transformers' norm (torch ops) and the residual's gradient added by autograd, in float32
        xr, wr = x0.float().clone().requires_grad_(), w0.float().clone().requires_grad_()
        yr = rms_norm(xr, wr, 1e-6, "torch")
        torch.autograd.backward((yr, xr), (dy.float(), dres.float()))
        assert torch.equal(y, rms_norm(x0, w0, 1e-6, "triton")), "the forward is the plain norm's"
        assert torch.equal(res, x0)
        for name, a, b in (("y", y, yr), ("dx", x.grad, xr.grad), ("dw", w.grad, wr.grad)):
            err = ((a.float() - b).norm() / b.norm()).item()
            assert err < tol, (dtype, shape, name, err)
        # only the residual used: its gradient passes through; only the norm used: the plain norm's backward
        x = x0.clone().requires_grad_()
        y, res = rms_norm_residual(x, w0, 1e-6, "triton")
        (res * dres).sum().backward()
        assert torch.equal(x.grad, dres)
        x, x2 = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        (rms_norm_residual(x, w0, 1e-6, "triton")[0] * dy).sum().backward()
        (rms_norm(x2, w0, 1e-6, "triton") * dy).sum().backward()
        assert torch.equal(x.grad, x2.grad)
print("FUSED RESIDUAL OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_triton_norm_sums_the_residual_gradient_in_its_backward(device):
    run_triton_script(_SCRIPT, device, "FUSED RESIDUAL OK")


_AC_SCRIPT = textwrap.dedent("""
import sys, torch
sys.path.insert(0, "tests")
from tiny_models import tiny_qwen3_moe
import workbench
from workbench.models.families.qwen3_moe.decoder import Qwen3MoeEngineDecoderLayer
from workbench.train.activation_checkpoint import apply_activation_checkpointing

device = sys.argv[1]
cfg = tiny_qwen3_moe(head_dim=16)
models = [workbench.AutoModelForCausalLM.from_config(cfg, device=device, dtype=torch.float32, seed=0) for _ in range(2)]
models[1].load_state_dict(models[0].state_dict())
assert all(type(layer) is Qwen3MoeEngineDecoderLayer for layer in models[0].model.layers)
assert apply_activation_checkpointing(models[1]) == cfg.num_hidden_layers
ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
for model in models:
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
grads = dict(models[1].named_parameters())
for name, p in models[0].named_parameters():
    err = ((grads[name].grad - p.grad).norm() / p.grad.norm().clamp_min(1e-30)).item()
    assert err < 1e-5, (name, err)
print("FUSED RESIDUAL AC OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_fused_decoder_layer_replays_under_activation_checkpointing(device):
    run_triton_script(_AC_SCRIPT, device, "FUSED RESIDUAL AC OK")


_HANDOFF_SCRIPT = textwrap.dedent("""
import sys, torch
sys.path.insert(0, "tests")
from tiny_models import tiny_qwen3_moe
import workbench
from workbench.moe.dispatch.local import LocalDispatcher

device = sys.argv[1]
cfg = tiny_qwen3_moe(head_dim=16)
model = workbench.AutoModelForCausalLM.from_config(cfg, device=device, dtype=torch.float32, seed=0)
seen = []
combine = LocalDispatcher.combine


def spy(self, y, handle, residual_TD=None, weighted=True):
    seen.append(residual_TD is not None)
    return combine(self, y, handle, residual_TD, weighted)


LocalDispatcher.combine = spy
ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
with torch.no_grad():
    base = model(input_ids=ids, use_cache=False).logits
assert seen == [True] * cfg.num_hidden_layers, seen  # every layer's residual add is in its experts' combine
# a hook on one MoE block: that block runs its own forward, its hook sees the block's output (not the residual
# stream), and the layer adds the residual itself
block, calls = model.model.layers[0].mlp, []
block.register_forward_hook(lambda module, args, out: calls.append((args[0], out)))
seen.clear()
with torch.no_grad():
    hooked = model(input_ids=ids, use_cache=False).logits
    hooked_seen = list(seen)
    x, out = calls[0]
    out = out[0] if isinstance(out, tuple) else out
    own = block.forward(x)
    own = own[0] if isinstance(own, tuple) else own
assert hooked_seen == [False] + [True] * (cfg.num_hidden_layers - 1), hooked_seen
torch.testing.assert_close(out, own, rtol=0, atol=0)
torch.testing.assert_close(hooked, base, rtol=1e-5, atol=1e-5)
print("RESIDUAL HANDOFF OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_the_decoder_layer_hands_the_residual_to_the_experts_combine_and_a_hooked_block_its_own_output(device):
    run_triton_script(_HANDOFF_SCRIPT, device, "RESIDUAL HANDOFF OK")


_COMBINE_SCRIPT = textwrap.dedent("""
import sys, torch
from workbench.moe.dispatch.local import LocalDispatcher

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
T, K, E, D = 13, 3, 5, 64
for combine in ("torch", "triton"):
    dispatcher = LocalDispatcher(E, combine)
    x = torch.randn(T, D, generator=g).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    w = torch.rand(T, K, generator=g).to(device).requires_grad_()
    residual = torch.randn(T, D, generator=g).to(device).requires_grad_()
    x_ND, _, handle = dispatcher.dispatch(x, ids, w)
    y = (x_ND * 1.5).detach().requires_grad_()
    upstream = torch.randn(T, D, generator=g).to(device)
    got = dispatcher.combine(y, handle, residual)
    grads = torch.autograd.grad(got, (y, w, residual), upstream)
    want = residual + dispatcher.combine(y, handle)
    want_grads = torch.autograd.grad(want, (y, w, residual), upstream)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip(grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert torch.equal(grads[2], upstream)  # the residual's gradient is the output's own
print("COMBINE RESIDUAL OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_local_combine_adds_the_residual_in_its_sum(device):
    run_triton_script(_COMBINE_SCRIPT, device, "COMBINE RESIDUAL OK")
