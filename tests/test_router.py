"""Router: balanced gate counts, the aux loss as Transformers computes it, native top-k."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny_models import tiny_qwen3_moe
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import workbench
from workbench.moe.hf_experts import engine_experts_modules
from workbench.moe.router import balanced_topk, load_balancing_loss, softmax_topk


@pytest.mark.parametrize("tokens,top_k,experts", [(64, 2, 8), (48, 8, 128 // 8), (30, 3, 5)])
def test_balanced_gate_gives_every_expert_the_same_count(tokens, top_k, experts):
    logits = torch.randn(tokens, experts)
    weights, ids = balanced_topk(logits, top_k, norm_topk_prob=True)
    counts = torch.bincount(ids.flatten(), minlength=experts)
    assert (counts == tokens * top_k // experts).all(), counts
    assert all(len(set(row.tolist())) == top_k for row in ids)  # distinct experts per token
    torch.testing.assert_close(weights.sum(-1), torch.ones(tokens))


def test_balanced_gate_in_the_model_counts_equal():
    # the generic path's per-layer counters (workbench.moe.routed_load) and its balanced gate
    from workbench.moe.routed_load import pop_routed_load as pop_expert_load

    cfg = tiny_qwen3_moe(num_experts=8, num_experts_per_tok=2)
    model = workbench.AutoModelForCausalLM.from_config(
        cfg, backend=workbench.BackendConfig(gate="balanced"), device="cpu"
    )
    ids = torch.randint(0, cfg.vocab_size, (4, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    load = pop_expert_load(model)
    assert load.shape == (2, 8) and (load == 4 * 16 * 2 // 8).all()
    assert (pop_expert_load(model) == 0).all()  # popping resets


def test_native_topk_matches_reference_softmax():
    logits = torch.randn(20, 6)
    for norm in (True, False):
        w, ids = softmax_topk(logits, 3, norm)
        probs = logits.softmax(-1)
        ref_w, ref_ids = probs.topk(3, dim=-1)
        if norm:
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w)


@pytest.mark.parametrize("masked", [False, True])
def test_aux_loss_equals_transformers(masked):
    layers = tuple(torch.randn(2 * 9, 8) for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(2, 9, dtype=torch.long)
        mask[1, 6:] = 0
    ours = load_balancing_loss(layers, 8, 2, mask)
    ref = load_balancing_loss_func(layers, 8, 2, mask)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=0)


def test_aux_loss_counts_every_layer_in_one_histogram_and_in_deterministic_mode():
    # one histc over the layers' ids (the last expert, E - 1, sits in the top bin) against a scatter_add a layer,
    # which torch.use_deterministic_algorithms keeps
    g = torch.Generator().manual_seed(3)
    layers = tuple(torch.randn(40, 7, generator=g) for _ in range(3))
    ids = tuple(torch.randint(0, 7, (40, 2), generator=g) for _ in range(3))
    ids[0][:, 0] = 6
    fast = load_balancing_loss(layers, 7, 2, topk_ids=ids)
    torch.use_deterministic_algorithms(True)
    try:
        kept = load_balancing_loss(layers, 7, 2, topk_ids=ids)
    finally:
        torch.use_deterministic_algorithms(False)
    probs = torch.cat([torch.softmax(z, dim=-1) for z in layers])
    counts = torch.bincount(torch.cat([i.reshape(-1) for i in ids]), minlength=7).float()
    want = (counts / probs.shape[0] * probs.mean(dim=0)).sum() * 7
    assert torch.allclose(fast, want, rtol=1e-6) and torch.allclose(kept, want, rtol=1e-6)


@pytest.mark.parametrize("groups,kept", [(2, 1), (1, 1), (4, 4), (4, 2)])
def test_deepseek_engine_router_equals_transformers(groups, kept):
    # bf16 weights and inputs (the engine's fast path), a correction bias that moves the choice; fresh inputs
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf

    from workbench.models.families.deepseek_v3.router import DeepseekV3EngineRouter, use_deepseek_router
    from workbench.presets import build_preset_config

    cfg = build_preset_config("tiny-deepseek-v3", 2)
    cfg.n_group, cfg.topk_group, cfg.n_routed_experts, cfg.num_experts_per_tok = groups, kept, 16, 3
    g = torch.Generator().manual_seed(groups * 10 + kept)
    ref = hf.DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(ref.weight.shape, generator=g) * 0.3)
        ref.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.2)
    ref = ref.to(torch.bfloat16)
    ref.e_score_correction_bias.data = ref.e_score_correction_bias.float()
    ours = hf.DeepseekV3TopkRouter(cfg).to(torch.bfloat16)
    ours.load_state_dict(ref.state_dict())
    ours.e_score_correction_bias.data = ref.e_score_correction_bias.clone()
    holder = torch.nn.ModuleList([ours])
    assert use_deepseek_router(holder) == 1 and type(ours) is DeepseekV3EngineRouter
    x = torch.randn(2, 37, cfg.hidden_size, generator=g).to(torch.bfloat16)
    x_ref, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    logits_r, weights_r, ids_r = ref(x_ref)
    logits_o, weights_o, ids_o = ours(x_ours)
    torch.testing.assert_close(logits_o, logits_r, rtol=1e-5, atol=1e-5)
    order_r, order_o = ids_r.sort(-1), ids_o.sort(-1)
    assert torch.equal(order_o.values, order_r.values)  # the same experts for every token
    torch.testing.assert_close(weights_o.gather(1, order_o.indices), weights_r.gather(1, order_r.indices))
    upstream = torch.randn(weights_r.shape, generator=g).to(weights_r.dtype)
    (weights_r.gather(1, order_r.indices) * upstream).sum().backward()
    (weights_o.gather(1, order_o.indices) * upstream).sum().backward()
    torch.testing.assert_close(x_ours.grad, x_ref.grad, rtol=2e-2, atol=1e-3)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=2e-2, atol=1e-3)
    if groups > kept:  # the limit really limits: some token's top-k avoids an expert it would otherwise pick
        free = (torch.sigmoid(logits_r) + ref.e_score_correction_bias).topk(3, dim=-1)[1].sort(-1).values
        assert not torch.equal(free, order_r.values)


def test_aux_loss_reuses_the_engine_routers_top_k_ids(monkeypatch):
    """The engine's Qwen3 router hands its top-k ids to the aux loss: one top-k per layer, the same loss and
    gradients as the formula's own top-k (and as Transformers' load_balancing_loss_func on the same logits)."""
    from generic_families import tiny_config

    from workbench.models.auto import AutoModelForCausalLM
    from workbench.models.router_aux import forward_loss_parts

    cfg = tiny_config("qwen3_moe", num_experts=8, num_experts_per_tok=3, num_hidden_layers=3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, device="cpu", dtype=torch.float32)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    kwargs = dict(input_ids=ids, labels=ids, use_cache=False)
    calls = []
    topk = torch.topk
    monkeypatch.setattr(torch, "topk", lambda *a, **k: calls.append(1) or topk(*a, **k))
    parts = forward_loss_parts(model, model, kwargs)
    assert len(parts.router_logits) == 3 and len(calls) == 3  # the routers' own: the aux loss sorted nothing
    monkeypatch.setattr(torch, "topk", topk)
    want = load_balancing_loss(parts.router_logits, 8, 3)  # the formula's own top-k
    assert torch.equal(parts.aux, want)
    assert torch.allclose(parts.aux, load_balancing_loss_func(parts.router_logits, 8, 3), rtol=1e-6, atol=0)
    grads = torch.autograd.grad(parts.aux, parts.router_logits, retain_graph=True)
    want_grads = torch.autograd.grad(want, parts.router_logits)
    assert all(torch.equal(g, w) for g, w in zip(grads, want_grads, strict=True))
    # a router that does not declare its ids (Transformers' own) leaves the formula its own top-k
    from workbench.models.families.qwen3_moe.router import Qwen3MoeEngineRouter

    monkeypatch.setattr(Qwen3MoeEngineRouter, "topk_ids_index", None)
    torch.manual_seed(0)
    undeclared = AutoModelForCausalLM.from_config(cfg, device="cpu", dtype=torch.float32)
    calls.clear()
    monkeypatch.setattr(torch, "topk", lambda *a, **k: calls.append(1) or topk(*a, **k))
    again = forward_loss_parts(undeclared, undeclared, kwargs)
    assert len(calls) == 6 and torch.equal(again.aux, parts.aux)


def test_routed_load_of_a_single_rank_dispatch_is_the_routers_choices():
    """The counter reuses the local dispatch's counts (no second scatter_add): they equal the router's top-k ids'
    per-expert counts, layer by layer; a dispatcher that does not count every expert leaves it counting itself."""
    from workbench.moe.dispatch.local import LocalDispatcher
    from workbench.moe.routed_load import pop_routed_load

    cfg = tiny_qwen3_moe(num_experts=8, num_experts_per_tok=3)
    model = workbench.AutoModelForCausalLM.from_config(cfg, device="cpu")
    routers = [m for m in model.modules() if "Router" in type(m).__name__]
    chosen = []
    for r in routers:
        r.register_forward_hook(lambda mod, args, out: chosen.append(out[2].reshape(-1)))
    ids = torch.randint(0, cfg.vocab_size, (3, 20))
    pop_routed_load(model)
    model(input_ids=ids, labels=ids).loss.backward()
    want = torch.stack([torch.bincount(c, minlength=8) for c in chosen])
    assert torch.equal(pop_routed_load(model), want) and int(want.sum()) == 2 * 3 * 20 * 3
    assert LocalDispatcher.caps.counts_every_expert
    experts = [m for _, m in engine_experts_modules(model)]
    assert experts and all(m.plan.counts_from_dispatch for m in experts)
    partial = dataclasses.replace(LocalDispatcher.caps, counts_every_expert=False)
    for m in experts:  # as an expert-parallel dispatcher: its counts are its own experts' rows
        m.use_dispatcher(type("Partial", (LocalDispatcher,), {"caps": partial})(8))
    assert not any(m.plan.counts_from_dispatch for m in experts)
    chosen.clear()
    model(input_ids=ids, labels=ids).loss.backward()
    assert torch.equal(pop_routed_load(model), torch.stack([torch.bincount(c, minlength=8) for c in chosen]))
