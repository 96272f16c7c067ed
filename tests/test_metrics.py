"""Metrics: the FLOPs formula (hand count, NeMo's Qwen3-30B-A3B figure), expert load CV, memory."""

import math

import pytest
import torch

from workbench.config import preset_config
from workbench.train.metrics import (expert_load_cv, expert_load_from_router_logits, flops_per_token, memory_gib,
                                     step_record, tflops_per_gpu)


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
        flops_per_token(cfg, 4096) * 8192 / 0.5 / 1e12)
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
    rec = step_record(step=1, rank=0, loss=2.0, grad_norm=1.0, lr=1e-3, tokens=1000, seq_len=128,
                      hf_config=preset_config("tiny"), timings={"step_time_s": 0.5, "forward_s": 0.2,
                                                                "backward_s": 0.2, "optimizer_s": 0.1},
                      device=torch.device("cpu"), expert_load=torch.tensor([[1, 3], [2, 2]]))
    assert rec["tokens_per_s_per_gpu"] == 2000 and rec["expert_load"] == [[1, 3], [2, 2]]
    assert math.isclose(rec["expert_load_cv"], 0.25) and rec["mem_kind"] == "cpu_rss"
    for key in ("step", "rank", "loss", "grad_norm", "lr", "tokens_per_s_per_gpu", "tflops_per_gpu",
                "mem_peak_gib", "mem_now_gib", "expert_load", "expert_load_cv", "step_time_s", "forward_s",
                "backward_s", "optimizer_s"):
        assert key in rec
