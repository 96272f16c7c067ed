"""Routing weights applied to the experts' rows before the down projection (moe/row_weights.py).

The combine then sums plain rows: same values and gradients as weighing in the combine (linear, bias-free down
projection), with the expert outputs no longer saved for the backward.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest
import torch
import transformers
from test_generic_families import _config, close, close_grads, randomize
from triton_script import DEVICES, run_triton_script

from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.moe import hf_experts
from workbench.moe.dispatch import NO_CAPS
from workbench.moe.dispatch.local import LocalDispatcher
from workbench.moe.hf_experts import engine_experts_modules

# Shape suffixes: N routed rows, D hidden.

needs_triton = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)"
)

_SCRIPT = textwrap.dedent("""
import sys, torch
from workbench.kernels.swiglu import swiglu_packed, swiglu_packed_weighted
from workbench.moe.dispatch.local import LocalDispatcher

device = sys.argv[1]
g = torch.Generator().manual_seed(0)
T, K, E, D, I = 13, 3, 5, 64, 48
for combine in ("torch", "triton"):
    dispatcher = LocalDispatcher(E, combine)
    x = torch.randn(T, D, generator=g).to(device)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).to(device)
    w = (0.1 + torch.rand(T, K, generator=g)).to(device).requires_grad_()
    residual = torch.randn(T, D, generator=g).to(device).requires_grad_()
    down = (torch.randn(I, D, generator=g) / I**0.5).to(device).requires_grad_()
    x_ND, _, handle = dispatcher.dispatch(x, ids, w)
    h = torch.randn(x_ND.shape[0], 2 * I, generator=g).to(device).requires_grad_()
    upstream = torch.randn(T, D, generator=g).to(device)
    leaves = (h, w, down, residual)
    # weighed in the combine (the reference) against weighed in the rows
    want = dispatcher.combine(swiglu_packed(h, combine) @ down, handle, residual)
    want_grads = torch.autograd.grad(want, leaves, upstream)
    shapes = []
    def pack(t):
        shapes.append(tuple(t.shape))
        return t
    rows = swiglu_packed_weighted(h, dispatcher.row_weights(handle), combine) @ down
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        got = dispatcher.combine(rows, handle, residual, weighted=False)
    assert (x_ND.shape[0], D) not in shapes, shapes  # the summed rows are not kept for the backward
    grads = torch.autograd.grad(got, leaves, upstream)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(("h", "w", "down", "residual"), grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{combine} {name}: {m}")
    # the weighted combine does keep them: what the row path saves
    shapes.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        dispatcher.combine(rows, handle, residual)
    assert (x_ND.shape[0], D) in shapes, shapes
    # no residual: the plain sum of each token's rows
    torch.testing.assert_close(
        dispatcher.combine(rows, handle, weighted=False),
        dispatcher.combine(rows, handle, residual, weighted=False) - residual, rtol=1e-5, atol=1e-5)
print("ROW WEIGHTS OK")
""")


@needs_triton
@pytest.mark.parametrize("device", DEVICES)
def test_weights_in_rows_equal_the_weighted_combine(device):
    run_triton_script(_SCRIPT, device, "ROW WEIGHTS OK")


def test_the_torch_reference_rounds_once_in_bf16():
    from workbench.kernels.swiglu import swiglu_packed_weighted

    g = torch.Generator().manual_seed(1)
    h = (2 * torch.randn(64, 96, generator=g)).to(torch.bfloat16)
    w = torch.rand(64, generator=g)
    exact = torch.nn.functional.silu(h[:, :48].double()).to(torch.bfloat16).double() * h[:, 48:].double()
    exact = exact * w.double().unsqueeze(-1)
    got = swiglu_packed_weighted(h, w).double()
    # one rounding of the product: within half a bf16 step of it (2**-8 relative)
    assert ((got - exact).abs() <= exact.abs() * 2**-8 + 1e-30).all()
    with pytest.raises(ValueError, match="one weight a row"):
        swiglu_packed_weighted(h, w[:-1])


@pytest.mark.parametrize(("family", "in_rows"), [("qwen3_moe", True), ("mixtral", True), ("gpt_oss", False)])
def test_families_with_a_plain_gate_take_the_weights_in_their_rows(family, in_rows, monkeypatch):
    cfg = _config(family)
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="grouped_mm"), device="cpu")
    eng.load_state_dict(ref.state_dict(), strict=True)
    experts = [m for _, m in engine_experts_modules(eng)]
    assert experts and all(m.plan.weights_in_rows is in_rows for m in experts)
    calls = []
    weighted = hf_experts.weighted_swiglu
    monkeypatch.setattr(hf_experts, "weighted_swiglu", lambda *a: calls.append(1) or weighted(*a))
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(5))
    out_ref = ref(input_ids=ids, labels=ids)
    out_eng = eng(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    out_eng.loss.backward()
    assert len(calls) == (len(experts) if in_rows else 0)
    close(out_eng.loss, out_ref.loss, f"{family} loss")
    close_grads(ref, eng, "")


def test_a_dispatcher_without_row_weights_keeps_the_weighted_combine():
    # alltoall and the others weigh in their combine: an experts module may apply weights only where its
    # dispatcher hands them out
    class Plain(LocalDispatcher):
        caps = NO_CAPS  # dispatch and a weighted combine only

    model = AutoModelForCausalLM.from_config(_config("mixtral"), backend=BackendConfig(experts="grouped_mm"))
    module = engine_experts_modules(model)[0][1]
    assert module.plan.gate_takes_weights and module.plan.weights_in_rows  # the local dispatcher hands them out
    module.use_dispatcher(Plain(module.num_experts))
    assert module.plan.gate_takes_weights and not module.plan.weights_in_rows
    calls = []
    module.plan.dispatcher.row_weights = lambda handle: calls.append(1)
    ids = torch.randint(0, 96, (2, 6))
    model(input_ids=ids, labels=ids).loss.backward()
    assert calls == []  # the combine weighed the rows


@needs_triton
def test_weighted_swiglu_kernels_compile_for_sm90():
    # the interpreter does not compile: this catches what only the GPU's compiler would refuse
    from compile_sm90 import compile_for_h200

    from workbench.kernels.triton_swiglu import BLOCK_I, _swiglu_fwd_kernel, _swiglu_weighted_bwd_kernel

    fwd_types = dict(G="*bf16", U="*bf16", Y="*bf16", WR="*fp32", stride_g="i32", stride_u="i32", stride_y="i32")
    fwd_types["I"] = "i32"
    fwd = compile_for_h200(_swiglu_fwd_kernel, fwd_types, dict(BLOCK=BLOCK_I, HAS_WR=True))
    bwd_types = dict(DY="*bf16", G="*bf16", U="*bf16", WR="*fp32", DG="*bf16", DU="*bf16", DWR="*fp32")
    bwd_types.update(stride_dy="i32", stride_g="i32", stride_u="i32", stride_dg="i32", stride_du="i32", I="i32")
    bwd = compile_for_h200(_swiglu_weighted_bwd_kernel, bwd_types, dict(BLOCK=BLOCK_I))
    for kernel in (fwd, bwd):
        assert "ld.local" not in kernel.asm["ptx"] and "st.local" not in kernel.asm["ptx"]  # no spills
    assert "scf.for" in bwd.asm["ttgir"]  # one program a row walks the row's blocks
