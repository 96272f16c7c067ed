"""Metrics: the FLOPs formula (hand count, NeMo's Qwen3-30B-A3B figure), expert load CV, memory."""

import math

import pytest
import torch

from workbench.config import preset_config
from workbench.train.metrics import (
    expert_load_cv,
    expert_load_from_router_logits,
    flops_per_token,
    memory_gib,
    step_record,
    tflops_per_gpu,
)


def test_qwen3_30b_a3b_matches_nemo_23_gflop_per_token():
    per_token = flops_per_token(preset_config("qwen3-30b-a3b"), seq_len=4096)
    assert abs(per_token / 23.0e9 - 1) < 0.01, per_token


def test_tiny_config_against_a_hand_count_of_the_real_modules():
    """6 x (matmul weights a token touches, counted on the HF model) + causal attention matmuls."""
    from transformers import Qwen3MoeForCausalLM

    cfg = preset_config("tiny", layers=3)
    model = Qwen3MoeForCausalLM(cfg)
    seq = 96
    per_token_params = model.lm_head.weight.numel()
    for layer in model.model.layers:
        attn = layer.self_attn
        per_token_params += sum(getattr(attn, n).weight.numel() for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        experts = layer.mlp.experts
        one_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // cfg.num_experts
        per_token_params += cfg.num_experts_per_tok * one_expert
    # Causal attention per token: QK^T and AV, each S * n_h * d multiply-adds; x2 FLOPs per
    # multiply-add, x3 for forward + two backward matmuls, x1/2 for the causal triangle.
    attention = cfg.num_hidden_layers * 6 * seq * cfg.num_attention_heads * cfg.head_dim
    hand = 6 * per_token_params + attention
    assert flops_per_token(cfg, seq) == pytest.approx(hand, rel=1e-12)


def test_dense_layers_count_their_own_width():
    cfg = preset_config("tiny", layers=2)
    cfg.mlp_only_layers = [0]
    moe_all = flops_per_token(preset_config("tiny", layers=2), 64)
    delta = 6 * cfg.hidden_size * 3 * (cfg.intermediate_size - cfg.moe_intermediate_size * cfg.num_experts_per_tok)
    assert flops_per_token(cfg, 64) == pytest.approx(moe_all + delta)


def test_tflops_per_gpu():
    cfg = preset_config("qwen3-30b-a3b", layers=8)
    assert tflops_per_gpu(cfg, 4096, tokens=8192, seconds=0.5) == pytest.approx(
        flops_per_token(cfg, 4096) * 8192 / 0.5 / 1e12
    )
    assert tflops_per_gpu(cfg, 4096, 8192, 0.0) == 0.0


def test_expert_load_cv():
    assert expert_load_cv([[5, 5, 5, 5], [2, 2, 2, 2]]) == 0.0
    # One layer [0, 4]: mean 2, population std 2 -> cv 1; the other balanced -> mean of (1, 0).
    assert expert_load_cv([[0, 4], [3, 3]]) == pytest.approx(0.5)
    assert expert_load_cv([]) == 0.0


def test_expert_load_from_router_logits():
    logits = torch.tensor([[5.0, 1.0, 0.0], [0.0, 1.0, 5.0], [5.0, 0.0, 1.0]])
    load = expert_load_from_router_logits((logits, logits), top_k=1, num_experts=3)
    assert load.tolist() == [[2, 0, 1], [2, 0, 1]]


def test_memory_and_record_on_cpu():
    peak, now, kind = memory_gib(torch.device("cpu"))
    assert kind == "cpu_rss" and peak > 0.01 and now > 0.01 and peak >= now * 0.5
    rec = step_record(
        step=1,
        rank=0,
        loss=2.0,
        grad_norm=1.0,
        lr=1e-3,
        tokens=1000,
        seq_len=128,
        hf_config=preset_config("tiny"),
        timings={"step_time_s": 0.5, "forward_s": 0.2, "backward_s": 0.2, "optimizer_s": 0.1},
        device=torch.device("cpu"),
        expert_load=torch.tensor([[1, 3], [2, 2]]),
    )
    assert rec["tokens_per_s_per_gpu"] == 2000 and rec["expert_load"] == [[1, 3], [2, 2]]
    assert math.isclose(rec["expert_load_cv"], 0.25) and rec["mem_kind"] == "cpu_rss"
    for key in (
        "step",
        "rank",
        "loss",
        "grad_norm",
        "lr",
        "tokens_per_s_per_gpu",
        "tflops_per_gpu",
        "mem_peak_gib",
        "mem_now_gib",
        "expert_load",
        "expert_load_cv",
        "step_time_s",
        "forward_s",
        "backward_s",
        "optimizer_s",
    ):
        assert key in rec


# -- every family -------------------------------------------------------------------------------


def _weights(module) -> int:
    """Weight-matrix elements of every nn.Linear under `module` (biases and norms excluded)."""
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def test_deepseek_v3_flops_against_a_hand_count_of_the_real_modules():
    """MLA (q/kv low-rank projections, d_qk = nope + rope != d_v), a dense first layer, shared experts."""
    import transformers

    cfg = preset_config("tiny-deepseek-v3", layers=3)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    seq = 96
    per_token_params = model.lm_head.weight.numel()
    attention = 0
    for layer in model.model.layers:
        per_token_params += _weights(layer.self_attn)  # q_a, q_b, kv_a_proj_with_mqa, kv_b, o
        if hasattr(layer.mlp, "experts"):
            experts = layer.mlp.experts
            one_expert = (experts.gate_up_proj.numel() + experts.down_proj.numel()) // cfg.n_routed_experts
            per_token_params += cfg.num_experts_per_tok * one_expert + _weights(layer.mlp.shared_experts)
        else:
            per_token_params += _weights(layer.mlp)  # the dense first layer
        # QK^T over d_qk = nope + rope, AV over d_v; S/2 keys per query (causal); x2 x3 FLOPs per MAC.
        d_qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        attention += 6 * cfg.num_attention_heads * (d_qk + cfg.v_head_dim) * seq / 2
    assert len([layer for layer in model.model.layers if hasattr(layer.mlp, "experts")]) == 2
    assert flops_per_token(cfg, seq) == pytest.approx(6 * per_token_params + attention, rel=1e-12)


def test_gpt_oss_flops_count_sliding_window_layers_by_their_mask():
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    from workbench.flops import attention_keys_per_query

    cfg = preset_config("tiny-gpt-oss", layers=4)
    seq, window = 96, cfg.sliding_window
    assert cfg.layer_types == ["sliding_attention", "full_attention"] * 2 and window < seq

    def keys(mask_fn) -> float:
        # Pairs the mask allows, less half the diagonal (NeMo's S/2 for a causal mask), per query.
        q, k = torch.arange(seq).view(-1, 1), torch.arange(seq).view(1, -1)
        pairs = int(mask_fn(torch.tensor(0), torch.tensor(0), q, k).expand(seq, seq).sum())
        return (pairs - seq / 2) / seq

    full, sliding = keys(causal_mask_function), keys(sliding_window_causal_mask_function(window))
    assert full == seq / 2 and attention_keys_per_query(seq, window) == pytest.approx(sliding)
    with torch.device("meta"):
        import transformers

        model = transformers.AutoModelForCausalLM.from_config(cfg)
    per_token_params = model.lm_head.weight.numel()
    for layer in model.model.layers:
        experts = layer.mlp.experts
        per_token_params += _weights(layer.self_attn)
        per_token_params += cfg.num_experts_per_tok * (experts.gate_up_proj.numel() + experts.down_proj.numel()) // 8
    attention = 2 * 6 * cfg.num_attention_heads * 2 * cfg.head_dim * (full + sliding)
    assert flops_per_token(cfg, seq) == pytest.approx(6 * per_token_params + attention, rel=1e-12)
    # No window counts once the sequence fits inside it.
    assert attention_keys_per_query(window, window) == window / 2
