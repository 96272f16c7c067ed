"""The Studio covers LoRA: the run panel's LoRA settings reach the RunConfig and the memory estimate."""

from __future__ import annotations

import pytest

pytest.importorskip("ipywidgets")

from workbench.config import ConfigError, LoraConfig, preset_config
from workbench.ui import MeshPanel, RunPanel


def test_run_panel_lora_settings_make_the_lora_section():
    panel = RunPanel()
    assert panel.run_config().lora is None  # off by default: full fine-tuning
    panel.lora.value, panel.lora_rank.value, panel.lora_alpha.value = True, 8, 16.0
    panel.lora_targets.value = ("attention", "experts", "shared_experts")
    assert panel.run_config().lora == LoraConfig(rank=8, alpha=16.0, targets=("attention", "experts", "shared_experts"))
    assert panel.training()["lora"] == panel.run_config().lora
    panel.lora_targets.value = ()
    with pytest.raises(ConfigError, match=r"lora\.targets"):
        panel.run_config()
    assert panel.training()["lora"] is None


def test_run_panel_cuda_graphs_setting():
    panel = RunPanel()
    assert not panel.run_config().train.cuda_graphs  # off by default
    panel.lora.value, panel.cuda_graphs.value = True, True  # LoRA's host-bound step replayed as CUDA graphs
    assert panel.run_config().train.cuda_graphs
    panel.activation_checkpointing.value = True
    with pytest.raises(ConfigError, match="activation checkpointing"):
        panel.run_config()


def test_mesh_panel_estimate_follows_lora():
    panel = MeshPanel(world_size=1, device_type="cuda", device_memory_gib=140)
    panel.set_model(preset_config("qwen3-30b-a3b", layers=4))
    panel.set_training(seq_len=4096, local_batch=1, dtype="bfloat16")
    full = panel.memory_estimate()
    panel.set_training(lora=LoraConfig(rank=16))
    lora = panel.memory_estimate()
    # frozen bf16 base: weights only instead of weights + grads + two AdamW moments
    assert lora.sharded_state < 0.3 * full.sharded_state
    assert "GiB" in panel.details.value


def test_run_panel_8bit_moments_reach_the_config_and_the_estimate():
    panel = RunPanel()
    assert panel.run_config().train.optimizer_states == "full"  # off by default
    changed = []
    panel.on_change(lambda: changed.append(True))
    panel.adamw_8bit.value = True
    assert changed and panel.run_config().train.optimizer_states == "8bit"
    assert panel.training()["optimizer_states"] == "8bit"
    mesh = MeshPanel(world_size=1, device_type="cuda", device_memory_gib=140)
    mesh.set_model(preset_config("gpt-oss-20b", layers=8))
    panel.seq_len.value, panel.local_batch.value = 4096, 2
    mesh.set_training(**{**panel.training(), "optimizer_states": "full"}, dtype="bfloat16")
    full = mesh.memory_estimate()
    mesh.set_training(**panel.training())
    eight = mesh.memory_estimate()
    # bf16: 8 bytes per parameter (param, grad, two moments) -> 6.125 (one byte per moment, scales per 64)
    assert eight.sharded_state == pytest.approx(full.sharded_state * 6.125 / 8)
    assert eight.activations == full.activations
