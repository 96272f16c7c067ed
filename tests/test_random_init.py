"""The seeded random-init build one decoder layer at a time (models/random_init.py): the same weights as
materializing and drawing the whole model in float32 then casting, with at most one layer in float32 at once."""

from __future__ import annotations

import pytest
import torch
import transformers

from tests.generic_families import tiny_config
from workbench.backends import BackendConfig
from workbench.models import generic, random_init
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.cast import cast_like_transformers
from workbench.moe.dispatch.local import LocalDispatcher


def _meta_engine(config):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    backend = BackendConfig().resolve(world_size=1, device="cpu")
    generic.install(model, backend, lambda n: LocalDispatcher(n, backend.combine), device=torch.device("cpu"))
    return model


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_blockwise_build_equals_the_whole_model_float32_draw_then_cast(family):
    config = tiny_config(family)
    whole = _meta_engine(config)
    whole.to_empty(device="cpu")
    generic.init_random(whole, 3)
    cast_like_transformers(whole, torch.bfloat16)
    blockwise = _meta_engine(config)
    random_init.materialize_random(blockwise, torch.device("cpu"), 3, torch.bfloat16)
    a, b = dict(whole.named_parameters()), dict(blockwise.named_parameters())
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert torch.equal(a[name], b[name]), name
    for (name, x), (_, y) in zip(whole.named_buffers(), blockwise.named_buffers(), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y), name
    assert any(p.dtype == torch.bfloat16 for p in b.values())


def test_at_most_one_decoder_layer_is_float32_while_the_build_draws(monkeypatch):
    config = tiny_config("qwen3_moe", num_hidden_layers=4)
    seen = []
    draw = generic.init_random

    def watching(model, seed, only=None):
        draw(model, seed, only)
        layers = random_init.decoder_layer_names(model)
        fp32 = [
            n
            for n in layers
            if any(p.dtype == torch.float32 and p.device.type != "meta" for p in model.get_submodule(n).parameters())
        ]
        seen.append(len(fp32))

    monkeypatch.setattr(generic, "init_random", watching)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, seed=0)
    assert len(random_init.decoder_layer_names(model)) == 4
    assert len(seen) == 5 and max(seen) <= 1, seen  # the outside block, then one call per layer
    assert all(p.dtype == torch.bfloat16 for n, p in model.named_parameters() if "correction_bias" not in n)
