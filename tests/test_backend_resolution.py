"""One BackendConfig resolution per build, with the mesh's ep, passed down to the mesh builders."""

from __future__ import annotations

import pytest
import torch
import transformers
from generic_families import tiny_config
from launch_utils import run_ranks
from tiny_models import tiny_qwen3_moe

from workbench import BackendConfig, BackendError
from workbench.backends import AUTO_ORDER, Platform, availability, pick_auto
from workbench.models.engine_state import engine_state
from workbench.ui.logic import resolve_auto

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
        out[(name, "auto", "resolved")] = engine_state(model).backend.dispatcher
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

    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    with pytest.raises(BackendError, match=EP_RULE):  # a dense model's mesh has ep=1: no dispatcher exchanges
        AutoModelForCausalLM.from_config(
            config, backend=BackendConfig(dispatcher="symm_mem"), mesh=MeshConfig(dp=2, ep=1)
        )
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


# ---------------------------------------------------------------- the resolver's inputs

# What the GPU paths pick on an H200 with triton (and without TE, as the GPU image has it), ep = 1.
H200_CHOICES = {
    "experts": "grouped_mm",
    "dispatcher": "local",
    "gate": "native",
    "attention": "sdpa",
    "rms_norm": "triton",
    "linear": "torch",
    "rope": "triton",
    "swiglu": "triton",
    "combine": "triton",
    "cross_entropy": "triton",
}


def _h200(*modules: str, gpus: int = 1) -> Platform:
    return Platform(device_type="cuda", capability=(9, 0), modules=frozenset(("triton", *modules)), gpus_per_node=gpus)


def test_a_cuda_platform_with_triton_resolves_todays_kernels():
    # Nothing here imports triton or needs a GPU: the Platform is the resolver's only view of the machine.
    resolved = BackendConfig().resolve(_h200())
    assert {f: getattr(resolved, f) for f in H200_CHOICES} == H200_CHOICES
    assert resolved.is_resolved()
    # ep = 2 changes only the dispatcher; an installed TE changes nothing (it lost to these paths in bf16)
    assert BackendConfig().resolve(_h200(gpus=2), world_size=2).to_dict() == {
        **resolved.to_dict(),
        "dispatcher": "alltoall",
    }
    assert BackendConfig().resolve(_h200("transformer_engine")) == resolved
    # fp8 -> TE linear where TE runs; without triton every Triton kernel falls back to its torch reference
    assert BackendConfig(fp8=True).resolve(_h200("transformer_engine")).linear == "te"
    bare = BackendConfig().resolve(Platform(device_type="cuda", capability=(9, 0)))
    assert {f for f in H200_CHOICES if getattr(bare, f) != H200_CHOICES[f]} == {
        "rms_norm",
        "rope",
        "swiglu",
        "combine",
        "cross_entropy",
    }
    assert all(getattr(bare, f) == "torch" for f in ("rms_norm", "rope", "swiglu", "combine", "cross_entropy"))


def test_detecting_this_machine_gives_what_resolving_its_device_gives():
    for device in ("cpu", "cuda"):
        plat = Platform.detect(device)
        assert plat.device_type == device
        assert BackendConfig().resolve(plat) == BackendConfig().resolve(device)


@pytest.mark.parametrize(
    "field,choice,install",
    [
        ("rms_norm", "triton", "pip install triton"),
        ("rope", "triton", "pip install triton"),
        ("cross_entropy", "triton", "pip install triton"),
        ("attention", "te", r"pip install 'moe-workbench\[te\]'"),
        ("experts", "te", r"pip install 'moe-workbench\[te\]'"),
        ("dispatcher", "deepep", r"pip install 'moe-workbench\[deepep\]'"),
    ],
)
def test_an_explicit_backend_the_platform_lacks_names_what_to_install(field, choice, install):
    with pytest.raises(BackendError, match=rf"{field}='{choice}' cannot run here: .*not installed: {install}"):
        BackendConfig(**{field: choice}).resolve(
            Platform(device_type="cuda", capability=(9, 0), gpus_per_node=8), world_size=2
        )


def test_every_auto_order_ends_in_a_choice_that_runs_anywhere():
    bare = Platform(grouped_mm=False)
    resolved = BackendConfig().resolve(bare, world_size=2)
    assert resolved.experts == "loop" and resolved.dispatcher == "alltoall"
    for field in AUTO_ORDER:
        assert pick_auto(field, lambda f, c: availability(f, c, bare), 1) is not None, field


def test_platform_refuses_unknown_inputs():
    with pytest.raises(BackendError, match="device_type"):
        Platform(device_type="gpu")
    with pytest.raises(BackendError, match=r"unknown.*liger"):
        Platform(modules=frozenset({"liger"}))
    with pytest.raises(BackendError, match=r"capability must be None or \(major, minor\)"):
        Platform(device_type="cuda", capability=9.0)
    with pytest.raises(BackendError, match="gpus_per_node"):
        Platform(gpus_per_node=-1)


def test_the_studio_auto_is_the_resolvers_auto():
    # ui/logic.resolve_auto had its own copy of the rule and ignored fp8 (linear='auto' is 'te' with fp8).
    for world_size in (1, 2):
        resolved = BackendConfig().resolve("cpu", world_size=world_size)
        for field in AUTO_ORDER:
            assert resolve_auto(field, None, "cpu", world_size) == getattr(resolved, field), (field, world_size)
    te_rank = {
        "rank": 0,
        "device": "cuda",
        "world_size": 1,
        "backends": {"linear.te": {"available": True, "reason": ""}},
    }
    assert resolve_auto("linear", [te_rank], "cuda", 1) == "torch"
    assert resolve_auto("linear", [te_rank], "cuda", 1, fp8=True) == "te"


def test_a_config_resolved_for_an_h200_wires_every_triton_kernel_into_the_model():
    # The build takes the resolved names and nothing else: on this CPU machine the model a CUDA rank
    # would build gets the same kernels (nothing runs here, the wiring is what is checked).
    from workbench.kernels.rms_norm import RMSNorm
    from workbench.models import generic
    from workbench.models.families.qwen3_moe.attention import Qwen3MoeEngineAttention
    from workbench.moe.dispatch.local import LocalDispatcher
    from workbench.moe.hf_experts import engine_experts_modules

    resolved = BackendConfig(fused_ce=True).resolve(_h200())
    model = transformers.AutoModelForCausalLM.from_config(tiny_qwen3_moe())
    generic.install(model, resolved, lambda n: LocalDispatcher(n, resolved.combine), device=torch.device("cpu"))
    experts = [m for _, m in engine_experts_modules(model)]
    assert experts and all(
        m.plan.backend == "grouped_mm" and m.plan.swiglu == "triton" and m.plan.dispatcher.use_triton for m in experts
    )
    attentions = [m for m in model.modules() if "Attention" in type(m).__name__]
    assert attentions and all(type(m) is Qwen3MoeEngineAttention and m.rope == "triton" for m in attentions)
    norms = [m for m in model.modules() if "RMSNorm" in type(m).__name__]
    assert norms and all(isinstance(m, RMSNorm) and m.backend == "triton" for m in norms)
    assert (
        engine_state(model).backend.cross_entropy == "triton"
        and type(model.get_output_embeddings()).__name__ == "DeferredLMHead"
    )


def test_detecting_a_cuda_platform_reads_the_gpu_only_for_the_packages_that_need_it(monkeypatch):
    # Reading the compute capability starts CUDA in the asking process (a notebook's Studio asks every
    # choice): only TE needs it, only DeepEP needs the GPU count.
    import workbench.backends as backends

    def touched(*_):
        raise AssertionError("read the GPU")

    monkeypatch.setattr(backends, "_cuda_capability", touched)
    monkeypatch.setattr(backends, "gpus_per_node", touched)
    monkeypatch.setattr(backends, "_has_module", lambda name: name == "triton")
    assert BackendConfig().resolve("cuda").rms_norm == "triton"
    assert availability("dispatcher", "deepep", "cuda", world_size=2)[0] is False
    monkeypatch.setattr(backends, "_has_module", lambda name: name in ("triton", "transformer_engine"))
    with pytest.raises(AssertionError, match="read the GPU"):
        Platform.detect("cuda")


def test_the_backend_panel_shows_fp8s_auto_linear():
    # The panel passes its fp8 box to the resolver and redraws when it changes (auto linear is TE with fp8).
    pytest.importorskip("ipywidgets", reason="the Studio's panels need the lab extra: pip install 'moe-workbench[lab]'")
    from workbench.ui.panels import BackendPanel

    te_rank = {
        "rank": 0,
        "device": "cuda",
        "world_size": 1,
        "backends": {"linear.te": {"available": True, "reason": ""}},
    }
    panel = BackendPanel([te_rank], "cuda", 1)
    assert panel.auto_resolution()["linear"] == "torch"
    panel.fp8.value = True
    assert panel.auto_resolution()["linear"] == "te"
    assert "te" in panel.rows["linear"].auto.value
