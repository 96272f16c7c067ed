"""The float32 routers' softmax + top-k in one Triton kernel each way (kernels/triton_router_topk.py,
BackendConfig.router), against torch's softmax_topk and Transformers' Qwen3-MoE."""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
from triton_script import DEVICES, run_triton_script

from workbench import BackendConfig
from workbench.backends import BackendError

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)"
)

_KERNEL_SCRIPT = textwrap.dedent("""
import sys, torch
from workbench.moe.router import softmax_topk, softmax_topk_triton

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
for T, E, K, norm in ((37, 128, 8, True), (5, 60, 4, False), (16, 8, 2, True), (0, 16, 2, True), (3, 5, 5, False)):
    z = (2 * torch.randn(T, E, generator=g)).to(device)
    gw = torch.randn(T, K, generator=g).to(device)
    res = {}
    for name, fn in (("torch", softmax_topk), ("triton", softmax_topk_triton)):
        leaf = z.clone().requires_grad_()
        w, ids = fn(leaf, K, norm)
        (w * gw).sum().backward()
        res[name] = (w.detach(), ids, leaf.grad)
    (w0, i0, g0), (w1, i1, g1) = res["torch"], res["triton"]
    assert i1.dtype == torch.int64 and w1.dtype == torch.float32 and g1.dtype == torch.float32
    assert torch.equal(i0, i1), (T, E, K, i0, i1)  # distinct values: the same experts in the same order
    torch.testing.assert_close(w1, w0, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-7)
# ties: k distinct experts, the lower id first
z = torch.zeros(3, 16, device=device)
z[:, 9] = z[:, 5] = 1.0
w, ids = softmax_topk_triton(z, 4, True)
assert ids.tolist() == [[5, 9, 0, 1]] * 3, ids
# a NaN row: its weights stay NaN, its ids distinct and in range (a later non-finite check stops the step)
z = torch.randn(2, 16, generator=g).to(device)
z[0, 3] = float("nan")
w, ids = softmax_topk_triton(z, 4, False)
assert torch.isnan(w[0]).all() and len(set(ids[0].tolist())) == 4 and ((ids >= 0) & (ids < 16)).all()
assert torch.equal(ids[1], softmax_topk(z[1:], 4, False)[1][0])
try:
    softmax_topk_triton(z.double(), 2, True)
except ValueError as err:
    assert "float32 logits" in str(err)
else:
    raise AssertionError("float64 logits were taken")
print("ROUTER TOPK OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_kernel_matches_torch_softmax_topk(device):
    run_triton_script(_KERNEL_SCRIPT, device, "ROUTER TOPK OK")


_MODEL_SCRIPT = textwrap.dedent("""
import sys, torch, transformers
sys.path.insert(0, "tests")
from tiny_models import tiny_qwen3_moe
import workbench
from workbench.models.families.qwen3_moe.router import Qwen3MoeEngineRouter

device = sys.argv[1]
cfg = tiny_qwen3_moe(hidden_size=64, moe_intermediate_size=32, head_dim=16)
ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").to(device)
models = {}
for router in ("torch", "triton"):
    backend = workbench.BackendConfig(experts="grouped_mm", router=router)
    models[router] = workbench.AutoModelForCausalLM.from_config(cfg, backend=backend, device=device, seed=0)
    models[router].load_state_dict(ref.state_dict())
routers = [m for m in models["triton"].modules() if isinstance(m, Qwen3MoeEngineRouter)]
assert len(routers) == cfg.num_hidden_layers and all(m.topk_backend == "triton" for m in routers)
ids = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(2)).to(device)
outs = {}
for name, model in (("hf", ref), *models.items()):
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    outs[name] = out
want = dict(ref.named_parameters())
for name, p in models["triton"].named_parameters():
    err = ((p.grad - want[name].grad).norm() / want[name].grad.norm()).item()
    assert err < 1e-4, (name, err)
assert abs(outs["triton"].loss.item() - outs["hf"].loss.item()) < 1e-5 * abs(outs["hf"].loss.item())
print("ROUTER TOPK MODEL OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_qwen3_with_the_triton_router_matches_transformers(device):
    run_triton_script(_MODEL_SCRIPT, device, "ROUTER TOPK MODEL OK")


def test_router_backend_resolves_and_refuses_triton_without_cuda():
    assert BackendConfig().resolve("cpu").router == "torch"
    with pytest.raises(BackendError, match=r"router='triton' needs a CUDA device.*use 'torch'"):
        BackendConfig(router="triton").resolve("cpu")


@needs_triton
def test_kernels_compile_for_sm90_without_spills():
    # the interpreter does not compile: this catches what only the GPU's compiler would refuse
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_router_topk import BLOCK_T, _topk_bwd_kernel, _topk_fwd_kernel

    flags = dict(K=8, K_P2=8, E_P2=128, BLOCK=BLOCK_T, NORM=True)
    fwd_types = dict(Z="*fp32", W="*fp32", IDS="*i64", T="i32", E="i32", stride_z="i32")
    bwd_types = dict(Z="*fp32", IDS="*i64", W="*fp32", GW="*fp32", GZ="*fp32", T="i32", E="i32", stride_z="i32")
    bwd_types["stride_gz"] = "i32"
    for kernel, types in ((_topk_fwd_kernel, fwd_types), (_topk_bwd_kernel, bwd_types)):
        ptx = compile_for_h200(kernel, types, flags).asm["ptx"]
        assert "ld.local" not in ptx and "st.local" not in ptx, kernel  # no spills
