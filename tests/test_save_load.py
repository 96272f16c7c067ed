"""Checkpoints move both ways between the engine and vanilla Transformers, unchanged."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import tiny_qwen3_moe

import workbench


def logits_of(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """The same tensors under the same names, bit for bit."""
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


def assert_logits_within_float32_rounding(got: torch.Tensor, ref: torch.Tensor, ulps: int = 16) -> None:
    """Equal up to float32 summation order: OpenMP splits matmul reductions by thread count, so
    two implementations agree bit for bit only on 1 thread (2 threads: ~2 ulps of the largest
    logit). A wrong weight or routing differs by orders of magnitude more."""
    assert got.dtype == ref.dtype == torch.float32
    tol = ulps * torch.finfo(torch.float32).eps * ref.abs().max().item()
    torch.testing.assert_close(got, ref, rtol=0, atol=tol)


def test_engine_save_loads_in_vanilla_transformers(tmp_path):
    cfg = tiny_qwen3_moe()
    torch.manual_seed(1)
    engine = workbench.AutoModelForCausalLM.from_config(cfg, device="cpu")
    engine.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["architectures"] == ["Qwen3MoeForCausalLM"]
    keys = set(load_file(tmp_path / "model.safetensors"))
    # Transformers' own on-disk layout: one tensor per expert and projection.
    assert "model.layers.0.mlp.experts.7.gate_proj.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(vanilla) is transformers.Qwen3MoeForCausalLM
    assert_same_weights(vanilla, engine)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    assert_logits_within_float32_rounding(logits_of(vanilla, ids), logits_of(engine, ids))


def test_hf_save_loads_into_engine(tmp_path):
    cfg = tiny_qwen3_moe(num_experts=6)
    torch.manual_seed(2)
    vanilla = transformers.AutoModelForCausalLM.from_config(cfg)
    vanilla.save_pretrained(tmp_path)
    engine = workbench.AutoModelForCausalLM.from_pretrained(tmp_path, device="cpu")
    assert workbench.moe.hf_experts.engine_experts_modules(engine)  # the generic engine path
    assert_same_weights(engine, vanilla)
    # And back to disk: the engine writes the file Transformers wrote, tensor for tensor.
    engine.save_pretrained(tmp_path / "again")
    first, again = load_file(tmp_path / "model.safetensors"), load_file(tmp_path / "again" / "model.safetensors")
    assert sorted(first) == sorted(again) and all(torch.equal(first[k], again[k]) for k in first)
    ids = torch.randint(0, cfg.vocab_size, (2, 13))
    assert_logits_within_float32_rounding(logits_of(engine, ids), logits_of(vanilla, ids))


def test_checkpoint_missing_expert_tensors_is_an_error(tmp_path):
    cfg = tiny_qwen3_moe()
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    dropped = [k for k in tensors if ".mlp.experts.3." in k]
    assert dropped
    save_file(
        {k: v for k, v in tensors.items() if k not in dropped},
        tmp_path / "model.safetensors",
        metadata={"format": "pt"},
    )
    with pytest.raises(workbench.CheckpointError, match="does not fit its config"):
        workbench.AutoModelForCausalLM.from_pretrained(tmp_path, device="cpu")


def test_fused_experts_get_the_generic_path_and_a_dense_model_vanilla_with_a_notice(caplog):
    from workbench.moe.hf_experts import engine_experts_modules

    cfg = transformers.MixtralConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    with caplog.at_level("WARNING", logger="workbench.models"):
        model = workbench.AutoModelForCausalLM.from_config(cfg)
    assert isinstance(model, transformers.MixtralForCausalLM) and engine_experts_modules(model)
    assert [r.getMessage() for r in caplog.records].count(
        "model_type 'mixtral': generic engine path (Transformers' router, Transformers' attention, the engine's "
        "experts in 1 MoE layers of 4 experts, backend grouped_mm)"
    ) == 1
    caplog.clear()
    with caplog.at_level("WARNING", logger="workbench.models"):
        workbench.AutoModelForCausalLM.from_config(tiny_qwen3_moe())
    # Qwen3's float32 router is the engine's on every device (the fused-RoPE attention needs rope='triton')
    assert any(
        "model_type 'qwen3_moe': generic engine path (the engine's float32 router, Transformers' attention, " in m
        for m in [r.getMessage() for r in caplog.records]
    ), [r.getMessage() for r in caplog.records]
    caplog.clear()
    dense = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    with caplog.at_level("WARNING", logger="workbench.models.auto"):
        model = workbench.AutoModelForCausalLM.from_config(dense)
    assert type(model) is transformers.LlamaForCausalLM
    assert "no fused experts in model_type='llama'" in caplog.text
