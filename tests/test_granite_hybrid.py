"""GraniteMoE-Hybrid (Granite 4.0) runs its Mamba2 layers on the engine's chunked scan (models/mixer_mamba2.py).

Its GraniteMoeHybridMambaLayer holds what Nemotron-H's Mamba2 holds (in_proj, a SiLU depthwise conv, dt_bias, A_log,
D, time_step_limit, a gated group RMSNorm, out_proj); the family's folder swaps in the engine's mixer. Checked:
float32 logits and every gradient against vanilla Transformers on fresh random weights and inputs, with sequences
longer than a few scan chunks, and Transformers' own mixer kept where BackendConfig.mixer says so.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from test_generic_families import close, close_grads, randomize

from workbench import AutoModelForCausalLM, BackendConfig
from workbench.models.mixer_mamba2 import EngineMamba2Mixer

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
