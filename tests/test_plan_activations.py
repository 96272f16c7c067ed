"""The plan's activations against what the engine really keeps for backward: the bytes autograd saves in one training
forward of a Qwen3-MoE at Qwen3-30B-A3B's width ratios (hidden H, experts' I = 3/8 H, 16 heads x 2 KV heads at
2H / H/4, top-8 of 16 experts), counted once per storage, against the plan's per-layer estimate, for LoRA (rank 16
on attention and experts) and full fine-tuning.

The engine's kernels are those CUDA runs (Triton's RMSNorm, norm + RoPE, packed weighted SwiGLU): Triton's
interpreter on a CPU machine, the compiled kernels on a GPU. torch's CPU kernels keep more (the norms' normalized
inputs, SwiGLU's silu and product), which is not what a planned GPU run holds.
"""

from __future__ import annotations

import textwrap

import pytest
from generic_families import tiny_config
from triton_script import DEVICES, run_triton_script

from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.moe.hf_experts import engine_experts_modules
from workbench.plan.estimate import rows_take_weights

_SCRIPT = textwrap.dedent("""
import sys, torch, transformers
import workbench
from workbench.config_lora import LoraConfig
from workbench.models.router_aux import ensure_router_logit_hooks, forward_loss_parts
from workbench.plan.estimate import GIB, estimate_memory

device = sys.argv[1]
H, LAYERS, SEQ, BATCH = 256, 2, 32, 1
cfg = transformers.Qwen3MoeConfig(
    hidden_size=H, intermediate_size=3 * H, moe_intermediate_size=3 * H // 8, num_attention_heads=16,
    num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=8, num_hidden_layers=LAYERS,
    vocab_size=512, max_position_embeddings=256, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
    router_aux_loss_coef=0.001, tie_word_embeddings=False,
)
tokens = SEQ * BATCH


def saved_per_layer(lora):
    # Bytes the backward keeps, per decoder layer: each saved tensor's storage counted once, the layer it was first
    # saved in; the weights' storages are the model's, not activations.
    model = workbench.AutoModelForCausalLM.from_config(cfg, lora=lora, seed=0, device=device).to(torch.bfloat16)
    model.train()
    ensure_router_logit_hooks(model)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layer_of, saved, now = {}, {}, [None]
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: now.__setitem__(0, i))
        layer.register_forward_hook(lambda m, a, o: now.__setitem__(0, None))

    def pack(t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if now[0] is not None and ptr not in weights and ptr not in layer_of:
            layer_of[ptr] = now[0]
            saved[now[0]] = saved.get(now[0], 0) + storage.nbytes()
        return t

    ids = torch.randint(0, cfg.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        # the trainer's forward: labels, the fused cross-entropy the engine defaults to, the aux loss
        parts = forward_loss_parts(model, model, dict(input_ids=ids, labels=ids, use_cache=False))
    (parts.ce + 0.001 * parts.aux).backward()  # what was saved is what the backward reads
    assert sorted(saved) == list(range(LAYERS)), saved
    return sum(saved.values()) / LAYERS


for name, lora in (("full", None), ("lora", LoraConfig(rank=16, targets=("attention", "experts")))):
    measured = saved_per_layer(lora)
    plan = estimate_memory(
        cfg, 1, 1, seq_len=SEQ, local_batch=BATCH, dtype="bfloat16", fused_ce=True, lora=lora
    ).activations / LAYERS
    off = plan / measured - 1
    print(f"{name}: saved {measured / tokens:.0f} B per token per layer, plan {plan / tokens:.0f} ({off:+.1%})")
    assert abs(off) <= 0.10, (name, measured, plan)
print("ACTIVATIONS OK")
""")


@pytest.mark.parametrize("device", DEVICES)
def test_plan_activations_match_what_the_engine_saves(device):
    run_triton_script(_SCRIPT, device, "ACTIVATIONS OK")


@pytest.mark.parametrize(
    ("family", "in_rows"),
    [("qwen3_moe", True), ("mixtral", True), ("deepseek_v3", True), ("gpt_oss", False), ("nemotron_h", False)],
)
def test_the_estimates_row_weights_rule_is_the_engines(family, in_rows):
    """The estimate counts no expert outputs where the built engine's rows take their routing weights (one rank)."""
    cfg = tiny_config(family)
    model = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="grouped_mm"), device="cpu")
    experts = [m for _, m in engine_experts_modules(model)]
    assert experts and all(m.plan.weights_in_rows is in_rows for m in experts)
    assert rows_take_weights(cfg, ep=1) is in_rows
    assert rows_take_weights(cfg, ep=2) is False  # the all-to-all combine weighs the rows itself
