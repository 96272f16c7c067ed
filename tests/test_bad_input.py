"""Bad input fails early with an error that says what to do."""

from __future__ import annotations

import importlib.util

import pytest
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import tiny_qwen3_moe

import workbench
from workbench import BackendConfig, BackendError


@pytest.mark.parametrize("kwargs,message", [
    (dict(experts="cutlass"), r"unknown experts backend 'cutlass'; choose one of \['loop', 'grouped_mm'"),
    (dict(dispatcher="nccl"), r"unknown dispatcher backend 'nccl'; choose one of"),
    (dict(gate="random"), r"unknown gate backend 'random'; choose one of \['native', 'balanced'\]"),
    (dict(attention="flash"), r"unknown attention backend 'flash'"),
    (dict(experts=3), r"BackendConfig.experts must be a string"),
    (dict(fused_ce="yes"), r"fused_ce must be True or False"),
])
def test_backend_config_rejects_bad_values(kwargs, message):
    with pytest.raises(BackendError, match=message):
        BackendConfig(**kwargs)


def test_backend_config_unknown_key():
    with pytest.raises(BackendError, match=r"unknown BackendConfig keys \['expert'\]"):
        BackendConfig.from_dict({"expert": "loop"})


@pytest.mark.parametrize("field,value,message", [
    ("experts", "te", r"transformer_engine is not installed: pip install 'moe-workbench\[te\]'"),
    ("attention", "te", r"moe-workbench\[te\]"),
    ("linear", "te", r"linear='te' cannot run here: transformer_engine is not installed: .*moe-workbench\[te\]"),
    ("rms_norm", "te", r"moe-workbench\[te\]"),
    ("dispatcher", "deepep", r"deep_ep is not installed: pip install 'moe-workbench\[deepep\]'"),
    ("dispatcher", "symm_mem", r"needs CUDA devices with NVSHMEM.*use 'alltoall'"),
    ("rms_norm", "triton", r"needs a CUDA device, got cpu; use 'torch'"),
])
def test_unavailable_backend_names_what_to_install(field, value, message):
    if value == "te" and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here; the error path needs it absent")
    with pytest.raises(BackendError, match=message):
        BackendConfig(**{field: value}).resolve("cpu")


def test_unavailable_backend_fails_before_building_the_model(monkeypatch):
    built = []
    monkeypatch.setattr(workbench.models.qwen3_moe.Qwen3MoeForCausalLM, "_from_config",
                        classmethod(lambda cls, *a, **k: built.append(1)))
    with pytest.raises(BackendError, match="needs a CUDA device"):
        workbench.AutoModelForCausalLM.from_config(tiny_qwen3_moe(), backend=BackendConfig(rms_norm="triton"),
                                                   device="cpu")
    assert not built


def test_backend_must_be_a_backend_config():
    with pytest.raises(TypeError, match="backend must be a workbench.BackendConfig"):
        workbench.AutoModelForCausalLM.from_config(tiny_qwen3_moe(), backend={"experts": "loop"})


def test_top_k_larger_than_expert_count():
    cfg = tiny_qwen3_moe(num_experts=4, num_experts_per_tok=2)
    cfg.num_experts_per_tok = 6
    with pytest.raises(ValueError, match=r"num_experts_per_tok=6 must be between 1 and num_experts=4"):
        workbench.AutoModelForCausalLM.from_config(cfg, device="cpu")


def test_checkpoint_missing_a_dense_tensor(tmp_path):
    transformers.AutoModelForCausalLM.from_config(tiny_qwen3_moe()).save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.q_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(workbench.CheckpointError, match=r"missing tensors \['model.layers.1.self_attn.q_proj"):
        workbench.AutoModelForCausalLM.from_pretrained(tmp_path, device="cpu")


def test_checkpoint_directory_that_does_not_exist(tmp_path):
    with pytest.raises(OSError, match="does-not-exist"):
        workbench.AutoModelForCausalLM.from_pretrained(tmp_path / "does-not-exist", device="cpu")
