"""LoRA export: PEFT loads the adapter with equal logits; the merged model; vLLM's per-expert files."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from generic_families import FAMILIES, tiny_config
from safetensors.torch import load_file
from test_lora import _config, randomize_adapters

from workbench import AutoModelForCausalLM
from workbench.config import LORA_TARGETS, LoraConfig
from workbench.models.lora_export import PEFT_MAMBA_TYPES, save_lora_adapter, save_merged, save_vllm_adapter

TARGETS = {
    "qwen3_moe": ("attention", "experts"),
    "mixtral": ("attention", "experts"),
    "gpt_oss": ("attention", "experts"),
    # MLA projections, shared experts and the dense first layer's MLP too
    "deepseek_v3": ("attention", "experts", "shared_experts", "dense_mlp"),
}


def _lora_model(family: str, tmp_path):
    cfg = _config(family)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", device="cpu", lora=LoraConfig(rank=4, alpha=6, targets=TARGETS[family])
    )
    randomize_adapters(model)
    return cfg, model.eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", list(TARGETS))
def test_peft_loads_the_adapter_with_equal_logits(family, tmp_path):
    peft = pytest.importorskip("peft", reason="pip install peft")
    cfg, model = _lora_model(family, tmp_path)
    save_lora_adapter(model, tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 6 and config["target_parameters"]
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = peft.PeftModel.from_pretrained(vanilla, tmp_path / "adapter").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    want = _logits(model, ids)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert (want - _logits(base, ids)).abs().max() > 1e-2  # the adapter changes the logits
    torch.testing.assert_close(_logits(peft_model, ids), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", list(TARGETS))
def test_merged_export_loads_in_vanilla_transformers_with_equal_logits(family, tmp_path):
    cfg, model = _lora_model(family, tmp_path)
    save_merged(model, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    torch.testing.assert_close(_logits(merged, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    assert not any("lora" in k for k in merged.state_dict())


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_vllm_adapter_is_per_expert_and_equals_the_merged_update(family, tmp_path):
    # vLLM's per-expert ("2D") MoE adapters: each expert's projection as its own adapter, under the
    # family's per-expert checkpoint names. Applied to the base checkpoint's per-expert tensors they
    # must give the merged export's tensors.
    cfg, model = _lora_model(family, tmp_path)
    save_vllm_adapter(model, tmp_path / "vllm")
    save_merged(model, tmp_path / "merged")
    adapter = load_file(tmp_path / "vllm" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "vllm" / "adapter_config.json").read_text())
    base = load_file(tmp_path / "base" / "model.safetensors")
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    scaling = config["lora_alpha"] / config["r"]
    per_expert = {
        "qwen3_moe": ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj", "mlp.experts.{e}.down_proj"),
        "mixtral": (
            "block_sparse_moe.experts.{e}.w1",
            "block_sparse_moe.experts.{e}.w3",
            "block_sparse_moe.experts.{e}.w2",
        ),
    }[family]
    for layer in range(cfg.num_hidden_layers):
        for e in range(4):  # every expert of every layer: vLLM packs all three projections per expert
            for proj in per_expert:
                name = f"model.layers.{layer}.{proj.format(e=e)}"
                a = adapter[f"base_model.model.{name}.lora_A.weight"]
                b = adapter[f"base_model.model.{name}.lora_B.weight"]
                assert a.shape[0] == b.shape[1] == 4
                torch.testing.assert_close(
                    base[f"{name}.weight"] + scaling * b @ a, merged[f"{name}.weight"], rtol=1e-5, atol=1e-6
                )
    assert not any("gate_up_proj" in k for k in adapter)
    assert {"q_proj", "o_proj", per_expert[0].rsplit(".", 1)[-1]} <= set(config["target_modules"])
    assert config["target_parameters"] is None


def test_vllm_adapter_refuses_a_family_fused_on_disk(tmp_path):
    _, model = _lora_model("gpt_oss", tmp_path)
    with pytest.raises(ValueError, match=r"keeps .* fused on disk.*save_lora_adapter"):
        save_vllm_adapter(model, tmp_path / "vllm")


def test_save_pretrained_of_a_lora_model_writes_merged_and_adapter(tmp_path):
    cfg, model = _lora_model("qwen3_moe", tmp_path)
    model.save_pretrained(tmp_path / "out")  # the engine model's own save_pretrained
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    torch.testing.assert_close(_logits(merged, ids), _logits(model, ids), rtol=1e-5, atol=1e-5)
    assert (tmp_path / "out" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_round_trips_through_peft_and_the_merged_export(family, tmp_path):
    # Every target the family has (shared experts, dense layers, the hybrids' mixers where present).
    peft = pytest.importorskip("peft", reason="pip install peft")
    from workbench.models.lora_targets import plan_lora
    from workbench.models.meta_model import meta_model

    cfg = tiny_config(family)
    targets = tuple(t for t, n in plan_lora(meta_model(cfg), LORA_TARGETS).by_target if n)
    if family in PEFT_MAMBA_TYPES:  # PEFT refuses a Mamba mixer's out_proj (tests/test_lora_hybrid.py)
        targets = tuple(t for t in targets if t != "mixer")
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", device="cpu", lora=LoraConfig(rank=4, targets=targets)
    ).eval()
    randomize_adapters(model, std=0.1)
    save_lora_adapter(model, tmp_path / "adapter")
    save_merged(model, tmp_path / "merged")
    peft_model = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    ).eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    want = _logits(model, ids)
    torch.testing.assert_close(_logits(peft_model, ids), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(_logits(merged, ids), want, rtol=1e-5, atol=1e-5)
