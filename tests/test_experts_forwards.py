"""An experts class that adds steps to Transformers' decorated forward is honoured by its family or refused, never
replaced silently: Ergo's ErgoExperts (a per-expert norm before the weighted sum) runs through its family's rows."""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from test_generic_families import close, randomize
from transformers.models.mixtral.modeling_mixtral import MixtralExperts

from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.families.ergo import expert_rows
from workbench.models.generic import UnsupportedModelError, check_experts_forwards, fused_experts_modules
from workbench.models.meta_model import meta_model
from workbench.moe.dispatch.local import LocalDispatcher
from workbench.moe.hf_experts import (
    decorated_experts_class,
    engine_experts_modules,
    install_engine_experts,
    own_forward_class,
)


class DoubledMixtralExperts(MixtralExperts):
    """A family's experts class with a step of its own after the decorated forward."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return 2 * super().forward(hidden_states, top_k_index, top_k_weights)


def _doubled_mixtral():
    model = meta_model(tiny_config("mixtral"))
    for _, module in fused_experts_modules(model):
        module.__class__ = DoubledMixtralExperts
    return model


def test_an_experts_class_with_its_own_forward_is_refused_naming_it():
    model = _doubled_mixtral()
    module = fused_experts_modules(model)[0][1]
    assert decorated_experts_class(type(module)) is MixtralExperts
    assert own_forward_class(module) is DoubledMixtralExperts
    why = r"DoubledMixtralExperts overrides the forward of MixtralExperts .* would skip"
    with pytest.raises(UnsupportedModelError, match=rf"model_type 'mixtral': model.layers.0.mlp.experts .*{why}"):
        check_experts_forwards(model)
    with pytest.raises(ValueError, match=why):  # the install itself refuses too: nothing replaces it silently
        install_engine_experts(module, LocalDispatcher(4), "grouped_mm", (0, 4), 4)
    assert not engine_experts_modules(model)


def test_the_plain_decorated_class_is_not_an_own_forward():
    model = meta_model(tiny_config("mixtral"))
    assert all(own_forward_class(m) is None for _, m in fused_experts_modules(model))
    check_experts_forwards(model)


def test_ergo_experts_are_honoured_by_the_family_and_refused_without_it():
    # Ergo's family reproduces ErgoExperts's forward (models/families/ergo); without its rows the install refuses it.
    model = meta_model(tiny_config("ergo"))
    check_experts_forwards(model)  # the family honours it
    module = fused_experts_modules(model)[0][1]
    assert type(module).__name__ == "ErgoExperts" and own_forward_class(module) is type(module)
    with pytest.raises(ValueError, match=r"ErgoExperts overrides the forward of ErgoExpertProjections"):
        install_engine_experts(module, LocalDispatcher(4), "grouped_mm", (0, 4), 4, honoured=("ErgoExperts",))


def test_ergo_per_expert_norm_is_refused_under_expert_parallelism():
    module = fused_experts_modules(meta_model(tiny_config("ergo")))[0][1]
    with pytest.raises(ValueError, match=r"per-expert parameters .*post_expert_norm.weight.*mesh ep=1"):
        install_engine_experts(
            module,
            LocalDispatcher(4),
            "grouped_mm",
            (0, 2),
            4,
            family_rows=expert_rows(module, "torch"),
            honoured=("ErgoExperts",),
        )


def test_ergo_per_expert_norm_shapes_the_output_and_trains():
    # The parity with vanilla (tests/test_census.py) would be vacuous if the norm's weights never mattered.
    cfg = tiny_config("ergo")
    ref = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    randomize(ref)
    eng = AutoModelForCausalLM.from_config(cfg, backend=BackendConfig(experts="grouped_mm"), device="cpu")
    eng.load_state_dict(ref.state_dict())
    ids = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(4))
    # return_logits: the default fused CE builds none (tests/test_fused_ce_default.py checks that path)
    out = eng(input_ids=ids, labels=ids, return_logits=True)
    close(out.logits, ref(input_ids=ids).logits, "ergo logits")
    out.loss.backward()
    norms = [m.post_expert_norm.weight for _, m in engine_experts_modules(eng)]
    assert norms and all(w.grad is not None and w.grad.abs().sum() > 0 for w in norms)
    with torch.no_grad():
        for w in norms:
            w.mul_(3.0)
    assert (eng(input_ids=ids).logits - out.logits).abs().max() > 1e-2
