"""The engine's state lives in engine objects: typed fields of the engine's own classes and one EngineState per model.

Before, the builders set dozens of `workbench_*` attributes on Transformers' modules and read them back with
getattr defaults; a typo or a forgotten set read as the default.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import transformers
from generic_families import tiny_config

from workbench import BackendConfig
from workbench.models.auto import AutoModelForCausalLM
from workbench.models.class_swap import swap_classes
from workbench.models.engine_state import EngineState, engine_state
from workbench.moe.dispatch import DispatcherCaps
from workbench.moe.dispatch.alltoall import AllToAllDispatcher
from workbench.moe.dispatch.deepep import DeepEPDispatcher
from workbench.moe.dispatch.local import LocalDispatcher
from workbench.moe.dispatch.symm_mem import SymmMemDispatcher
from workbench.moe.hf_experts import engine_experts_modules

ROOT = Path(__file__).resolve().parents[1]


def _sources() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), p.read_text()) for p in sorted((ROOT / "workbench").rglob("*.py"))]


def test_the_engine_sets_and_reads_one_attribute_of_its_own_on_a_model():
    sets = [f"{f}:{m.group(0)}" for f, s in _sources() for m in re.finditer(r"\.workbench_[a-z_]+ *=[^=]", s)]
    reads = [f"{f}:{m.group(0)}" for f, s in _sources() for m in re.finditer(r"getattr\([^)]*workbench_[a-z_]*", s)]
    assert [s.split(":")[0] for s in sets] == ["workbench/models/engine_state.py"], sets
    assert [r.split(":")[0] for r in reads] == ["workbench/models/engine_state.py"], reads


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3", "mixtral"])
def test_no_module_of_a_built_model_holds_a_workbench_attribute_but_the_models_state(family):
    cfg = tiny_config(family)
    model = AutoModelForCausalLM.from_config(
        cfg, backend=BackendConfig(experts="grouped_mm", fused_ce=True), device="cpu", dtype=torch.float32
    )
    found = {
        f"{name or '<model>'}.{key}"
        for name, module in model.named_modules()
        for key in vars(module)
        if key.startswith("workbench_")
    }
    assert found == {"<model>.workbench_state"}
    state = engine_state(model)
    assert isinstance(state, EngineState) and state.backend is not None and state.backend.is_resolved()
    assert state.router_sink is not None or family == "deepseek_v3"  # DeepSeek-V3 has no aux loss
    experts = engine_experts_modules(model)
    assert experts and all(m.plan.dispatcher is not None for _, m in experts)
    with pytest.raises(dataclasses.FrozenInstanceError):
        experts[0][1].plan.swiglu = "triton"  # resolved once, at install
    # the engine's modules keep Transformers' names: the state dict is the vanilla model's
    vanilla = transformers.AutoModelForCausalLM.from_config(cfg)
    assert list(model.state_dict()) == list(vanilla.state_dict())


def test_every_dispatcher_declares_what_it_offers_as_typed_caps():
    for cls in (LocalDispatcher, AllToAllDispatcher, SymmMemDispatcher, DeepEPDispatcher):
        assert isinstance(cls.caps, DispatcherCaps), cls
    assert LocalDispatcher.caps == DispatcherCaps(True, True, True)
    assert AllToAllDispatcher.caps == DispatcherCaps()


def test_a_class_swap_sets_only_fields_the_engine_class_declares():
    class Engine(torch.nn.Linear):
        backend: str = "torch"

    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="declares no field workbench_backend"):
        swap_classes(model, torch.nn.Linear, Engine, workbench_backend="triton")
    assert swap_classes(model, torch.nn.Linear, Engine, backend="triton") == 1
    assert type(model[0]) is Engine and model[0].backend == "triton"
