"""bf16 engine models keep what Transformers' own bf16 build keeps in float32 (models/cast.py): the rotary
frequencies (a bf16 `inv_freq` turns each position's rotation by up to ~2e-3 * position radians) and the
score-correction biases; the bf16 engine then matches vanilla bf16 Transformers at long positions."""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from test_generic_families import randomize

from workbench.models.auto import AutoModelForCausalLM
from workbench.models.cast import cast_like_transformers, computed_float32_buffers


def _vanilla_bf16(cfg, seed: int = 0):
    """Transformers' own bf16 model (`dtype=` build) with fresh random weights."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="eager")
    randomize(model)
    return model


def _float32_buffers(model) -> dict[str, torch.Tensor]:
    # the unsaved ones (rotary frequencies): the score-correction bias, float32 in the engine always, is bf16 in
    # Transformers 5.17's `dtype=` build (5.24 keeps it float32); tests/test_generic_features.py covers it
    computed = {id(m._buffers[name]) for m, name in computed_float32_buffers(model)}
    return {n: b for n, b in model.named_buffers() if id(b) in computed}


def _trainer_build(path: str | None = None, preset: str | None = None):
    """The model the Trainer trains (train/model_setup.build_model), bf16 on CPU, one process."""
    from workbench.config import ModelConfig, RunConfig, preset_config
    from workbench.train.model_setup import build_model

    rc = RunConfig.demo(model=ModelConfig(preset=preset, path=path, dtype="bfloat16", device="cpu"))
    hf_config = transformers.AutoConfig.from_pretrained(path) if path else preset_config(preset)
    return build_model(rc, hf_config, None, torch.device("cpu"), torch.bfloat16)


FAMILIES = {
    "qwen3_moe": "tiny",
    "gpt_oss": "tiny-gpt-oss",
    "deepseek_v3": "tiny-deepseek-v3",
    "mixtral": "tiny-mixtral",
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_engine_builds_keep_transformers_float32_buffers(family, tmp_path):
    cfg = tiny_config(family)
    vanilla = _vanilla_bf16(cfg)
    want = _float32_buffers(vanilla)
    assert any("inv_freq" in n for n in want), sorted(want)  # the property holds something here
    vanilla.save_pretrained(tmp_path)
    built = {
        "trainer, checkpoint": _trainer_build(path=str(tmp_path)),
        "trainer, preset": _trainer_build(preset=FAMILIES[family]),
        "from_config": AutoModelForCausalLM.from_config(cfg, device="cpu", dtype=torch.bfloat16),
    }
    for how, model in built.items():
        got = _float32_buffers(model)
        assert got.keys() == want.keys(), (how, sorted(got), sorted(want))
        for name, buf in want.items():
            if how != "trainer, preset":  # another config (the preset's): the same names, its own values
                assert torch.equal(got[name], buf), (how, name)
        assert any(p.dtype == torch.bfloat16 for p in model.parameters()), how


def test_computed_buffers_are_the_unsaved_float32_ones():
    model = _vanilla_bf16(tiny_config("qwen3_moe"))
    names = {name for _, name in computed_float32_buffers(model)}
    assert "inv_freq" in names and not names & set(model.state_dict())  # never saved with the weights
    cast = cast_like_transformers(
        transformers.AutoModelForCausalLM.from_config(tiny_config("qwen3_moe")), torch.bfloat16
    )
    assert cast.model.rotary_emb.inv_freq.dtype == torch.float32 and cast.lm_head.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_bf16_trainer_model_rotates_as_vanilla_bf16_at_long_positions(family, tmp_path):
    """The Trainer's bf16 model's cos/sin equal vanilla bf16 Transformers' up to position 4095 (a bf16 inv_freq
    put them up to 0.39 apart there in this tiny config: angles off by a fraction of a radian)."""
    cfg = tiny_config(family, max_position_embeddings=4096)
    vanilla = _vanilla_bf16(cfg)
    vanilla.save_pretrained(tmp_path)
    engine = _trainer_build(path=str(tmp_path))
    x = torch.zeros(1, 1, dtype=torch.bfloat16)
    positions = torch.arange(4096)[None]
    with torch.no_grad():
        want = vanilla.model.rotary_emb(x, positions)
        got = engine.model.rotary_emb(x, positions)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, b), (a.float() - b.float()).abs().max()
