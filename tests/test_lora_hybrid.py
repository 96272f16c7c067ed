"""LoRA on hybrid families: targets found by what the modules are (Nemotron-H names every block `mixer`), the
sequence mixers' projections as the `mixer` target, training on the CPU, and the exports vanilla tools load."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from generic_families import census_config, tiny_config
from test_lora import randomize_adapters

from workbench import AutoModelForCausalLM, BackendConfig
from workbench.config import ConfigError, LoraConfig
from workbench.models.lora import adapter_parameters
from workbench.models.lora_check import check_lora_targets
from workbench.models.lora_export import save_lora_adapter, save_merged
from workbench.models.lora_targets import plan_lora
from workbench.models.meta_model import meta_model

HYBRID_TARGETS = ("attention", "mixer", "experts")


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


def test_nemotron_h_targets_are_its_attention_mamba_and_experts():
    # Nemotron-H names every block `mixer`: attention, Mamba2 and MoE blocks alike.
    plan = plan_lora(meta_model(tiny_config("nemotron_h")), HYBRID_TARGETS + ("shared_experts",))
    layers = {n.split(".")[2]: [] for n in plan.linears}
    for name in plan.linears:
        layers[name.split(".")[2]].append(name.split(".", 4)[-1])
    # hybrid_override_pattern "ME*E": Mamba2, MoE, attention, MoE
    assert layers["0"] == ["in_proj", "out_proj"]
    assert layers["2"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert layers["1"] == layers["3"] == ["shared_experts.up_proj", "shared_experts.down_proj"]
    assert [name for name, _ in plan.experts] == ["model.layers.1.mixer.experts", "model.layers.3.mixer.experts"]
    assert dict(plan.by_target) == {"attention": 4, "mixer": 2, "experts": 2, "shared_experts": 4}


def test_gemma4_experts_beside_the_dense_mlp_are_found():
    # Gemma 4 keeps its experts in the decoder layer itself, beside a dense MLP every token passes through.
    plan = plan_lora(meta_model(census_config("gemma4_text")), ("experts", "shared_experts", "dense_mlp"))
    assert [name for name, _ in plan.experts] == ["model.layers.0.experts", "model.layers.1.experts"]
    counts = dict(plan.by_target)
    assert counts["shared_experts"] == 6 and counts["dense_mlp"] == 0, counts


@pytest.mark.parametrize("family", ["qwen3_5_moe_text", "qwen3_next"])
def test_gated_deltanet_projections_are_the_mixer_target(family):
    plan = plan_lora(meta_model(tiny_config(family)), ("attention", "mixer"))
    mixer = [n for n in plan.linears if ".linear_attn." in n]
    attention = [n for n in plan.linears if ".self_attn." in n]
    assert mixer and attention and len(mixer) + len(attention) == len(plan.linears)
    assert {n.rsplit(".", 1)[-1] for n in mixer} >= {"out_proj"}
    assert dict(plan.by_target) == {"attention": len(attention), "mixer": len(mixer)}


def test_mixer_on_a_family_without_mixers_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match=r"\['mixer'\] match nothing in model_type 'qwen3_moe'.*no sequence mixers"):
        check_lora_targets(tiny_config("qwen3_moe"), LoraConfig(rank=2, targets=("attention", "mixer")))


@pytest.mark.parametrize("mixer", ["transformers", "chunked"])
def test_nemotron_h_lora_on_attention_mamba_and_experts_trains(mixer):
    cfg = tiny_config("nemotron_h")
    model = AutoModelForCausalLM.from_config(
        cfg, seed=0, device="cpu", backend=BackendConfig(mixer=mixer), lora=LoraConfig(rank=4, targets=HYBRID_TARGETS)
    )
    adapters = dict(adapter_parameters(model))
    for needle in ("mixer.in_proj.lora_A", "mixer.out_proj.lora_B", "mixer.q_proj.lora_A", "mixer.experts.up_proj"):
        assert any(needle in n for n in adapters), needle
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n not in adapters}
    opt = torch.optim.AdamW(adapters.values(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.vocab_size, (4, 16), generator=g)
    losses = []
    for _ in range(12):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if not losses:  # every adapter gets a gradient (B is zero at the start: A's comes from B's first step)
            assert all(adapters[n].grad is not None for n in adapters if "lora_B" in n or "_lora_b" in n)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    for name, param in model.named_parameters():
        if name in frozen:
            assert torch.equal(param, frozen[name]) and param.grad is None, name
    moved = [n for n in adapters if "lora_B" in n and adapters[n].abs().sum() > 0 and ".mixer.in_proj" in n]
    assert moved, "the Mamba2 in_proj adapters never trained"


def _hybrid_lora(family, targets, tmp_path):
    cfg = tiny_config(family)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "base", device="cpu", lora=LoraConfig(rank=4, alpha=6, targets=targets)
    ).eval()
    randomize_adapters(model, std=0.1)
    return cfg, model


@pytest.mark.parametrize(
    "family, targets",
    [
        ("nemotron_h", ("attention", "experts", "shared_experts")),
        ("qwen3_5_moe_text", HYBRID_TARGETS),
        ("qwen3_next", HYBRID_TARGETS),
    ],
)
def test_peft_loads_a_hybrid_adapter_with_equal_logits(family, targets, tmp_path):
    peft = pytest.importorskip("peft", reason="pip install peft")
    cfg, model = _hybrid_lora(family, targets, tmp_path)
    save_lora_adapter(model, tmp_path / "adapter")
    vanilla = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = peft.PeftModel.from_pretrained(vanilla, tmp_path / "adapter").eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    want = _logits(model, ids)
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    assert (want - _logits(base, ids)).abs().max() > 1e-3  # the adapters change the logits
    torch.testing.assert_close(_logits(peft_model, ids), want, rtol=1e-5, atol=1e-5)


def test_nemotron_h_mamba_adapters_export_merged_and_peft_refusal_is_named(tmp_path, caplog):
    # PEFT refuses LoRA on a Mamba model's out_proj (as a module or a parameter): the PEFT folder is refused with
    # the reason before anything is written, and save_pretrained writes the merged model vanilla Transformers loads.
    peft = pytest.importorskip("peft", reason="pip install peft")
    from workbench.models import lora_export

    cfg, model = _hybrid_lora("nemotron_h", HYBRID_TARGETS, tmp_path)
    with pytest.raises(ValueError, match=r"PEFT refuses LoRA on \['out_proj'\] of Mamba models.*save_merged"):
        save_lora_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    # the refusal is PEFT's: the same folder written anyway is refused by PEFT's loader
    tensors = lora_export.adapter_tensors(model)
    lora_export._write(tmp_path / "forced", lora_export.peft_tensors(model, tensors), lora_export.peft_config(model))
    assert json.loads((tmp_path / "forced" / "adapter_config.json").read_text())["target_modules"]
    with pytest.raises(ValueError, match="incompatible with Mamba"):
        peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "forced"
        )

    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(2))
    want = _logits(model, ids)
    model.save_pretrained(tmp_path / "out")  # merged, and no adapter folder PEFT could not load
    assert not (tmp_path / "out" / "adapter").exists()
    assert "PEFT refuses LoRA" in caplog.text
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    torch.testing.assert_close(_logits(merged, ids), want, rtol=1e-5, atol=1e-5)
    save_merged(model, tmp_path / "merged")
    torch.testing.assert_close(
        _logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged"), ids), want, rtol=1e-5, atol=1e-5
    )
