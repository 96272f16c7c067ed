"""Bad input fails early with an error that says what to do."""

from __future__ import annotations

import importlib.util
import os
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from tiny_models import tiny_qwen3_moe

import workbench
from workbench import BackendConfig, BackendError
from workbench.config import ConfigError, ModelConfig


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(experts="cutlass"), r"unknown experts backend 'cutlass'; choose one of \['loop', 'grouped_mm'"),
        (dict(dispatcher="nccl"), r"unknown dispatcher backend 'nccl'; choose one of"),
        (dict(gate="random"), r"unknown gate backend 'random'; choose one of \['native', 'balanced'\]"),
        (dict(attention="flash"), r"unknown attention backend 'flash'"),
        (dict(experts=3), r"BackendConfig.experts must be a string"),
        (dict(fused_ce="yes"), r"fused_ce must be True, False or 'auto'; got 'yes'"),
        (dict(expert_recompute="yes"), r"expert_recompute must be True or False"),
    ],
)
def test_backend_config_rejects_bad_values(kwargs, message):
    with pytest.raises(BackendError, match=message):
        BackendConfig(**kwargs)


def test_backend_config_unknown_key():
    with pytest.raises(BackendError, match=r"unknown BackendConfig keys \['expert'\]"):
        BackendConfig.from_dict({"expert": "loop"})


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("experts", "te", r"transformer_engine is not installed: pip install 'moe-workbench\[te\]'"),
        ("attention", "te", r"moe-workbench\[te\]"),
        ("linear", "te", r"linear='te' cannot run here: transformer_engine is not installed: .*moe-workbench\[te\]"),
        ("rms_norm", "te", r"moe-workbench\[te\]"),
        ("dispatcher", "deepep", r"deep_ep is not installed: pip install 'moe-workbench\[deepep\]'"),
        ("dispatcher", "symm_mem", r"needs CUDA devices with NVSHMEM.*use 'alltoall'"),
        ("rms_norm", "triton", r"needs a CUDA device, got cpu; use 'torch'"),
    ],
)
def test_unavailable_backend_names_what_to_install(field, value, message):
    if value == "te" and importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("transformer_engine is installed here; the error path needs it absent")
    with pytest.raises(BackendError, match=message):
        # ep=2: with ep=1 the dispatchers' ep rule is said first (test_backend_resolution)
        BackendConfig(**{field: value}).resolve("cpu", world_size=2)


def test_unavailable_backend_fails_before_building_the_model(monkeypatch):
    built, real = [], transformers.AutoModelForCausalLM.from_config

    def recording(*args, **kwargs):  # the meta build that reads the model's structure allocates nothing
        if torch.empty(0).device.type != "meta":
            built.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_config", recording)
    with pytest.raises(BackendError, match="needs a CUDA device"):
        workbench.AutoModelForCausalLM.from_config(
            tiny_qwen3_moe(), backend=BackendConfig(rms_norm="triton"), device="cpu"
        )
    assert not built


def test_backend_must_be_a_backend_config():
    with pytest.raises(TypeError, match=r"backend must be a workbench\.BackendConfig"):
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


# -- errors before the run directory ----------------------------------------------------------------


def _finetune_refused(rc, runs_dir, match):
    with pytest.raises(ConfigError, match=match):
        workbench.finetune(rc.replace(output_dir=str(runs_dir)))
    assert not runs_dir.exists() or not any(runs_dir.iterdir()), list(runs_dir.iterdir())


def test_seq_len_above_max_position_embeddings_is_refused_before_the_run_directory(tmp_path):
    rc = workbench.RunConfig.demo(
        data__kind="synthetic",
        data__seq_len=4096,
        train__steps=1,
        train__global_batch_size=1,
        train__local_batch_size=1,
    )
    _finetune_refused(
        rc,
        tmp_path / "runs",
        r"data.seq_len \(4096\) exceeds the model's max_position_embeddings \(2048\); "
        r"set data.seq_len to 2048 or less",
    )


@pytest.mark.parametrize(
    "text,match",
    [
        ("{not json", r"config.json is not valid JSON \(Expecting property name.*line 1 column 2"),
        ("[1, 2]", r"config.json must hold a JSON object, got list"),
        (
            '{"model_type": "foobar_moe", "hidden_size": 8}',
            r"config.json has model_type 'foobar_moe', which Transformers .* does not know\. "
            r"Model families the engine supports: every Transformers v5 family with fused experts "
            r"\(tested: .*qwen3_moe",
        ),
        (
            '{"model_type": "qwen3moe"}',
            r"config.json has model_type 'qwen3moe', .* does not know \(did you mean 'qwen3_moe'",
        ),
        ('{"hidden_size": 8}', r"config.json has no model_type\. Model families the engine supports"),
    ],
)
def test_bad_model_config_json_names_the_file_before_the_run_directory(tmp_path, text, match):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(text)
    rc = workbench.RunConfig.demo(model=ModelConfig(preset=None, path=str(model_dir)))
    _finetune_refused(rc, tmp_path / "runs", "^" + re.escape(f"{model_dir}{os.sep}") + match)
