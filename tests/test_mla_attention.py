"""DeepSeek-V3's latent attention with the fused q/k/v kernel (kernels/triton_mla.py, deepseek_v3/attention.py).

The kernel against Transformers' own split/rotate/cat steps in float64 (interleaved and rotate_half RoPE,
values and gradients), then the whole tiny engine model against Transformers in float32, with q_lora_rank
and without, and its generation (a KV cache: Transformers' forward). A subprocess, so TRITON_INTERPRET applies
before triton is imported.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from triton_script import run_triton_script

_SCRIPT = textwrap.dedent("""
import sys, torch
sys.path.insert(0, "tests")
from test_parity import fresh_batch, forward_backward, rel_err
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf
from workbench.kernels.triton_mla import mla_qkv
device = sys.argv[1]
g = torch.Generator().manual_seed(7)
B, S, H, NOPE, R, V = 2, 5, 3, 16, 8, 12
for interleave in (True, False):
    q = torch.randn(B, S, H, NOPE + R, generator=g, dtype=torch.float64).requires_grad_()
    kvb = torch.randn(B, S, H, NOPE + V, generator=g, dtype=torch.float64).requires_grad_()
    lat = torch.randn(B, S, 20 + R, generator=g, dtype=torch.float64).requires_grad_()
    cos, sin = torch.randn(2, B, S, R, generator=g, dtype=torch.float64)
    kr = lat[..., 20:]
    # Transformers' own steps, float64
    qt = q.transpose(1, 2)
    q_pass, q_rot = torch.split(qt, [NOPE, R], dim=-1)
    k_rot = kr.view(B, 1, S, R)
    f = hf.apply_rotary_pos_emb_interleave if interleave else hf.apply_rotary_pos_emb
    q_rot, k_rot = f(q_rot, k_rot, cos, sin)
    ref_q = torch.cat((q_pass, q_rot), -1)
    kvt = kvb.transpose(1, 2)
    k_nope, ref_v = torch.split(kvt, [NOPE, V], -1)
    ref_k = torch.cat((k_nope, k_rot.expand(-1, H, -1, -1)), -1)
    w = [torch.randn(t.shape, generator=g, dtype=torch.float64) for t in (ref_q, ref_k, ref_v)]
    ref_grads = torch.autograd.grad(sum((a * b).sum() for a, b in zip((ref_q, ref_k, ref_v), w)), (q, kvb, lat))
    args = [t.detach().float().to(device).requires_grad_() for t in (q, kvb, lat)]
    cos_d, sin_d = cos.float().to(device), sin.float().to(device)
    outs = mla_qkv(args[0], args[1], args[2][..., 20:], cos_d, sin_d, NOPE, interleave)
    for o, r in zip(outs, (ref_q, ref_k, ref_v)):
        err = rel_err(o.transpose(1, 2).cpu().double(), r)
        assert err < 1e-6, (interleave, err)
    grads = torch.autograd.grad(sum((o.transpose(1, 2) * ww.float().to(device)).sum() for o, ww in zip(outs, w)), args)
    for a, b in zip(grads, ref_grads):
        assert rel_err(a.cpu().double(), b) < 1e-6, (interleave, rel_err(a.cpu().double(), b))
# shapes the kernel cannot take are refused, not computed wrong: an odd rotary dim
odd = torch.zeros(B, S, H, NOPE + 3, device=device)
try:
    mla_qkv(odd, torch.zeros(B, S, H, NOPE + V, device=device), torch.zeros(B, S, 3, device=device),
            torch.zeros(B, S, 3, device=device), torch.zeros(B, S, 3, device=device), NOPE, True)
except ValueError as err:
    assert "unsupported shapes" in str(err), err
else:
    raise AssertionError("an odd rotary dim was not refused")
print("kernel ok")
import workbench
from workbench.presets import build_preset_config
from workbench.models.families.deepseek_v3.attention import DeepseekV3EngineAttention
import transformers
import warnings
import workbench.kernels.triton_mla as tm
# count the fused kernel's calls: parity alone holds on Transformers' own forward too
calls = []
real_qkv, real_supported = tm.mla_qkv, tm.angles_supported
tm.mla_qkv = lambda *a: calls.append(1) or real_qkv(*a)
for overrides in ({}, {"q_lora_rank": None, "rope_interleave": False}):
    cfg = build_preset_config("tiny-deepseek-v3", 3)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    torch.manual_seed(3)
    hf_model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").float()
    backend = workbench.BackendConfig(experts="grouped_mm")
    engine = workbench.AutoModelForCausalLM.from_config(cfg, backend=backend, device=device)
    engine.load_state_dict(hf_model.state_dict())
    kinds = [type(layer.self_attn) for layer in engine.model.layers]
    assert all(k is DeepseekV3EngineAttention for k in kinds), kinds
    hf_model.to(device), engine.to(device)
    ids, labels = (t.to(device) for t in fresh_batch(cfg, 6))
    ref, ref_grads = forward_backward(hf_model, ids, labels)
    calls.clear()
    # one training forward with its logits (forward_backward runs a second, label-free one for the fused CE's): the
    # count below is one forward's
    engine.zero_grad(set_to_none=True)
    out = engine(input_ids=ids, labels=labels, output_router_logits=True, use_cache=False, return_logits=True)
    out.loss.backward()
    grads = {n: p.grad.detach().float().clone() for n, p in engine.named_parameters() if p.grad is not None}
    assert len(calls) == cfg.num_hidden_layers, calls
    tol = 1e-5 if device == "cpu" else 1e-4
    errs = rel_err(out.loss, ref.loss), rel_err(out.logits, ref.logits)
    assert max(errs) < tol, errs
    for name, gr in ref_grads.items():
        assert rel_err(grads[name], gr) < tol, (name, rel_err(grads[name], gr))
    with torch.no_grad():  # generation (a KV cache) runs Transformers' own forward
        a = engine(input_ids=ids, use_cache=True).logits
        b = hf_model(input_ids=ids, use_cache=True).logits
    assert rel_err(a, b) < tol
    # one layer on cos/sin as transposed views (GPT-OSS's layout on Transformers 5.17): still the fused kernel
    attn = engine.model.layers[0].self_attn
    x = torch.randn(2, 6, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(device)
    ang = torch.randn(2, cfg.qk_rope_head_dim, 6, generator=torch.Generator().manual_seed(5)).to(device).transpose(1, 2)
    pe = (ang.cos(), ang.sin())
    assert pe[0].stride(-1) != 1
    calls.clear()
    got = attn(x, pe, None)[0]
    assert len(calls) == 1, calls
    attn.rope = "torch"  # Transformers' own forward on the same module
    want = attn(x, pe, None)[0]
    attn.rope = "triton"
    assert rel_err(got, want) < tol, rel_err(got, want)
    # angles the kernel refuses: Transformers' forward, said in a warning
    tm.angles_supported = lambda *a: False
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        again = attn(x, pe, None)[0]
    tm.angles_supported = real_supported
    assert any("fused MLA kernel does not take" in str(w.message) for w in said), [str(w.message) for w in said]
    assert rel_err(again, want) < tol
print("TRITON MLA OK")
""")


@pytest.mark.slow  # Triton's interpreter on a CPU machine (tests/triton_script.py)
def test_mla_kernel_and_engine_match_transformers():
    # the compiled kernel where a GPU is present; Triton's interpreter otherwise (the GPU image's Triton 3.6
    # interpreter cannot run the RMSNorm backward's tensor-bounded loop that the whole model needs)
    run_triton_script(_SCRIPT, "cuda" if torch.cuda.is_available() else "cpu", "TRITON MLA OK")
