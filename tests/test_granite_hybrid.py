"""GraniteMoE-Hybrid (Granite 4.0) runs its Mamba2 layers on the engine's chunked scan (models/mixer_mamba2.py).

Its GraniteMoeHybridMambaLayer holds what Nemotron-H's Mamba2 holds (in_proj, a SiLU depthwise conv, dt_bias, A_log,
D, time_step_limit, a gated group RMSNorm, out_proj); the family's folder swaps in the engine's mixer. Checked:
float32 logits and every gradient against vanilla Transformers on fresh random weights and inputs, with sequences
longer than a few scan chunks, and Transformers' own mixer kept where BackendConfig.mixer says so; its layers counted
from the config (a Mamba2 or attention, then the MoE and its shared MLP) as Transformers builds them.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from test_generic_families import close, close_grads, randomize

from workbench import AutoModelForCausalLM, BackendConfig
from workbench.models.meta_model import meta_model
from workbench.models.mixer_mamba2 import EngineMamba2Mixer
from workbench.params import param_counts

pytestmark = pytest.mark.skipif(
    "granitemoehybrid" not in transformers.CONFIG_MAPPING,
    reason=f"transformers {transformers.__version__} has no granitemoehybrid",
)


def _pair(mixer: str):
    cfg = tiny_config("granitemoehybrid")
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=torch.float32)
    randomize(ref, seed=2)
    eng = AutoModelForCausalLM.from_config(
        # fused_ce off: the comparison reads the logits of a forward with labels
        cfg,
        backend=BackendConfig(experts="grouped_mm", mixer=mixer, fused_ce=False),
        device="cpu",
        dtype=torch.float32,
    )
    eng.load_state_dict(ref.state_dict(), strict=True)
    return cfg, ref, eng


@pytest.mark.parametrize("mixer", ["chunked", "transformers"])
def test_granite_hybrid_equals_vanilla_with_the_engine_mamba2(mixer):
    cfg, ref, eng = _pair(mixer)
    mamba = eng.model.layers[0].mamba
    assert isinstance(mamba, EngineMamba2Mixer) == (mixer == "chunked"), type(mamba)
    # 19 tokens: four chunks of 4 and a partial one
    ids = torch.randint(0, cfg.vocab_size, (2, 19), generator=torch.Generator().manual_seed(8))
    out_ref = ref(input_ids=ids, labels=ids)
    out_eng = eng(input_ids=ids, labels=ids)
    close(out_eng.logits, out_ref.logits, f"granitemoehybrid ({mixer}) logits")
    out_ref.loss.backward()
    out_eng.loss.backward()
    close_grads(ref, eng, f"granitemoehybrid ({mixer})")
    for name in ("in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight"):
        grad = mamba.get_parameter(name).grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_granite_hybrid_parameters_by_hand():
    # H = 32, V = 96; layer 0 a Mamba2 of 8 heads of 8 (inner 64), 2 groups of state 8, conv kernel 4 with bias;
    # layer 1 attention (4 heads of 8, 2 kv heads); each layer an MoE of 4 SwiGLU experts of width 16 (top 2), a
    # SwiGLU shared MLP of width 16 and a router, and two norms
    cfg = tiny_config("granitemoehybrid")
    counts = param_counts(cfg)
    in_width = 2 * 64 + 2 * 2 * 8 + 8  # z, x|B|C, dt
    mamba = 32 * in_width + 64 * 32 + (96 * 4 + 96) + 3 * 8 + 64  # projections, conv, dt_bias/A_log/D, norm
    assert (counts.mixer_per_layer, counts.attention_per_layer) == (mamba, 32 * (32 + 2 * 16) + 32 * 32)
    moe = 4 * 32 + 3 * 32 * 16 + 4 * 3 * 32 * 16  # router, shared MLP, experts
    total = 2 * 96 * 32 + 5 * 32 + mamba + 3072 + 2 * moe
    assert counts.total == total == 32984 == sum(p.numel() for p in meta_model(cfg).parameters())
    assert counts.active_matmul == 96 * 32 + 3072 + (32 * in_width + 64 * 32) + 2 * (3 * 1536) == 22784
