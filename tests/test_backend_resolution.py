"""One BackendConfig resolution per build, with the mesh's ep, passed down to the mesh builders (issue 14 item 4)."""

from __future__ import annotations

import pytest
import torch
import transformers
from dist_utils import run_ranks
from generic_families import tiny_config
from tiny_models import tiny_qwen3_moe

from workbench import BackendConfig, BackendError
from workbench.backends import availability

EP_RULE = "ep >= 2"
# What each dispatcher needs from the machine: the reason a CPU gloo rank must give on an ep=2 mesh.
MACHINE_REASON = {"symm_mem": "needs CUDA devices with NVSHMEM", "deepep": "deep_ep is not installed"}


def _configs():
    return {"qwen3_moe": tiny_qwen3_moe(), "mixtral": tiny_config("mixtral")}


def _refusals_worker(rank, world, checkpoints):
    from workbench.models.auto import AutoModelForCausalLM
    from workbench.parallel.mesh import MeshConfig

    mesh = MeshConfig(dp=2, ep=2)
    out = {}
    for dispatcher in MACHINE_REASON:
        backend = BackendConfig(dispatcher=dispatcher)
        for name, config in _configs().items():
            try:
                AutoModelForCausalLM.from_config(config, backend=backend, mesh=mesh, seed=0)
                out[(name, dispatcher, "from_config")] = "built"
            except BackendError as err:
                out[(name, dispatcher, "from_config")] = str(err)
        for name, path in checkpoints.items():
            try:
                AutoModelForCausalLM.from_pretrained(path, backend=backend, mesh=mesh)
                out[(name, dispatcher, "from_pretrained")] = "built"
            except BackendError as err:
                out[(name, dispatcher, "from_pretrained")] = str(err)
    # 'auto' resolves for the mesh's ep: the model runs (and records) alltoall, not local.
    for name, config in _configs().items():
        model = AutoModelForCausalLM.from_config(config, mesh=mesh, seed=0)
        out[(name, "auto", "resolved")] = model.workbench_backend.dispatcher
    return out


@pytest.mark.slow
def test_symm_mem_and_deepep_on_an_ep2_mesh_fail_only_for_what_the_machine_lacks(tmp_path):
    # The old code resolved with world_size=1 before looking at the mesh: "needs ep >= 2" on an ep=2 mesh.
    checkpoints = {}
    for name, config in _configs().items():
        path = tmp_path / name
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
        checkpoints[name] = str(path)
    for result in run_ranks(_refusals_worker, 2, checkpoints, timeout=300):
        for (name, dispatcher, how), message in result.items():
            if dispatcher == "auto":
                assert message == "alltoall", (name, message)
                continue
            assert MACHINE_REASON[dispatcher] in message and EP_RULE not in message, (name, dispatcher, how, message)


def _dense_worker(rank, world):
    from workbench.models.auto import AutoModelForCausalLM
    from workbench.parallel.mesh import MeshConfig

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2)
    with pytest.raises(BackendError, match=EP_RULE):  # a dense model's mesh has ep=1: no dispatcher exchanges
        AutoModelForCausalLM.from_config(config, backend=BackendConfig(dispatcher="symm_mem"),
                                         mesh=MeshConfig(dp=2, ep=1))
    model = AutoModelForCausalLM.from_config(config, mesh=MeshConfig(dp=2, ep=1))
    return type(model).__name__


@pytest.mark.slow
def test_the_vanilla_path_resolves_the_same_way():
    # The old code never resolved for a model without engine blocks: symm_mem on ep=1 went unnoticed.
    assert all("Llama" in name for name in run_ranks(_dense_worker, 2, timeout=300))


def _builders_worker(rank, world):
    from workbench.models.mesh_build import build_generic_parallel_model
    from workbench.parallel.mesh import MeshConfig

    mesh = MeshConfig(dp=2, ep=2)
    messages = {}
    for name, config in _configs().items():
        for how, backend in (("unresolved", BackendConfig()), ("local", BackendConfig().resolve("cpu", world_size=1))):
            try:
                build_generic_parallel_model(config, backend, mesh)
                messages[(name, how)] = "built"
            except ValueError as err:
                messages[(name, how)] = str(err)
    return messages


@pytest.mark.slow
def test_mesh_builders_take_a_resolved_config_and_do_not_resolve_again():
    # The builder refuses what models/auto should have resolved (with the mesh's ep), for every family.
    for messages in run_ranks(_builders_worker, 2, timeout=300):
        assert set(messages) == {(name, how) for name in _configs() for how in ("unresolved", "local")}
        for name in _configs():
            assert "take a resolved BackendConfig" in messages[(name, "unresolved")], messages
            assert "world_size=mesh.ep" in messages[(name, "local")], messages


@pytest.mark.parametrize("dispatcher", ["symm_mem", "deepep"])
def test_the_ep_rule_is_said_before_what_the_machine_lacks(dispatcher):
    ok, why = availability("dispatcher", dispatcher, torch.device("cpu"), world_size=1)
    assert not ok and EP_RULE in why, why
    ok, why = availability("dispatcher", dispatcher, torch.device("cpu"), world_size=2)
    assert not ok and MACHINE_REASON[dispatcher] in why, why
