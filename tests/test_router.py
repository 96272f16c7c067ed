"""Router: balanced gate counts, the aux loss as Transformers computes it, native top-k."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_qwen3_moe
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import workbench
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
