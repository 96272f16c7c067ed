"""Build the sharded model: the engine's (meta build, then only this rank's tensors) or any other (FSDP2 over dp)."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn

from workbench.backends import BackendConfig
from workbench.devices import default_device
from workbench.models import generic
from workbench.models.cast import cast_like_transformers
from workbench.models.engine_state import engine_state
from workbench.models.lora import apply_lora
from workbench.models.random_init import materialize_random
from workbench.models.sliced_load import disk_rules, init_nonpersistent_buffers, load_rank_slice, plan_rank_read
from workbench.moe.dispatch import make_dispatcher
from workbench.moe.hf_experts import EngineExperts, engine_experts_modules
from workbench.parallel.fsdp import EXPERT_SHARD_ATTR, GRAD_NORM_GROUP_ATTR, apply_fsdp_any, decoder_layers
from workbench.parallel.mesh import MeshConfig, MeshError
from workbench.params import num_experts as config_num_experts

log = logging.getLogger(__name__)


def check_mesh_call(mesh) -> None:
    """Refuse mesh= without a process group, or of the wrong type (before anything is resolved or built)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "mesh= needs an initialized process group (torchrun, workbench.Cluster, "
            "or torch.distributed.init_process_group)"
        )
    if not isinstance(mesh, MeshConfig):
        raise TypeError(f"mesh must be a workbench.MeshConfig, got {type(mesh).__name__}")


def _check_resolved(backend: BackendConfig, mesh: MeshConfig) -> None:
    # The builders run what they are given: resolution happens once, in models/auto, with the mesh's ep.
    if not isinstance(backend, BackendConfig) or not backend.is_resolved():
        raise ValueError(
            f"the mesh builders take a resolved BackendConfig, got {backend!r}; pass "
            "backend.resolve(default_device(), world_size=mesh.ep)"
        )
    if backend.dispatcher == "local" and mesh.ep > 1:
        raise ValueError(
            f"dispatcher 'local' keeps every token on its rank, but mesh ep={mesh.ep} splits the "
            "experts: resolve the BackendConfig with world_size=mesh.ep"
        )


def check_mesh_for_model(mesh: MeshConfig, config) -> None:
    """Refuse ep > 1 for a dense model; a MoE model whose experts the engine cannot split is refused at all."""
    if not isinstance(mesh, MeshConfig):
        raise TypeError(f"mesh must be a workbench.MeshConfig, got {type(mesh).__name__}")
    if mesh.ep == 1:
        return

    model_type = getattr(config, "model_type", None)
    if generic.has_fused_experts(config):  # refuses experts it cannot split
        return
    if not config_num_experts(config):
        raise MeshError(
            f"mesh ep={mesh.ep} splits experts, but model_type {model_type!r} has none (a dense "
            f"model); use ep=1 (FSDP2 data parallelism over all {mesh.dp} ranks) or leave the mesh unset"
        )


def shard_without_engine(model: nn.Module, mesh: MeshConfig) -> nn.Module:
    """A Transformers model without fused experts on this rank's device, FSDP2-sharded over dp."""
    if not dist.is_initialized():
        raise RuntimeError(
            "mesh= needs an initialized process group (torchrun, workbench.Cluster, "
            "or torch.distributed.init_process_group)"
        )
    check_mesh_for_model(mesh, model.config)
    mesh.validate(dist.get_world_size())
    device = default_device()
    model.to(device)
    device_mesh = mesh.build(device.type)
    if dist.get_world_size() > 1:
        # Every rank built the same full model (same seed or checkpoint): each keeps its shards.
        apply_fsdp_any(model, device_mesh)
    state = engine_state(model)
    state.mesh, state.device_mesh = mesh, device_mesh
    return model


def apply_fsdp_generic(model: nn.Module, device_mesh) -> nn.Module:
    """FSDP2 per decoder layer over dp, each engine experts module over the expert-data-parallel dim."""
    inside = sum(isinstance(m, EngineExperts) for layer in decoder_layers(model) for m in layer.modules())
    total = len(engine_experts_modules(model))
    if inside != total:
        # The root's dense-mesh shard would treat each ep rank's different experts as one replicated tensor.
        raise RuntimeError(
            f"{type(model).__name__}: {total - inside} of {total} experts modules lie outside "
            "the decoder layers FSDP2 shards one by one; expert parallelism cannot shard them"
        )
    edp = device_mesh["edp"]
    return apply_fsdp_any(
        model, device_mesh, inner=lambda layer: [(m, edp) for m in layer.modules() if isinstance(m, EngineExperts)]
    )


def _mark_expert_params(model: nn.Module, device_mesh) -> None:
    """Mark expert parameters as ep shards (for checkpoints) and give grad clipping their norm group, ep.

    Under expert parallelism each ep rank holds different experts and FSDP2 shards them only
    over the expert-data-parallel dim, so their DTensor mesh does not show the ep split. The experts
    modules' own parameters are tagged, not their submodules': a post-expert norm is shared by all
    experts, replicated over ep.
    """
    ep_group = device_mesh.get_group("ep")
    params = [p for _, m in engine_experts_modules(model) for p in m.parameters(recurse=False)]
    for param in params:
        setattr(param, GRAD_NORM_GROUP_ATTR, ep_group)
        setattr(param, EXPERT_SHARD_ATTR, True)


def build_generic_parallel_model(
    config,
    backend: BackendConfig,
    mesh: MeshConfig,
    checkpoint=None,
    dtype: torch.dtype | None = None,
    seed: int = 0,
    lora=None,
    **hf_kwargs,
):
    """A model with v5 fused experts on `mesh`: experts sliced by ep, FSDP2 over dp per decoder layer.

    Built on the meta device; then only this rank's experts are allocated, and either initialized
    (models/generic.init_random) or read from `checkpoint`: its dense tensors and only this rank's
    experts' slices (models/sliced_load). A disk layout that reader does not know is loaded whole
    by Transformers on every rank, which then keeps only its experts (one log line says so).
    """
    import transformers

    check_mesh_call(mesh)
    _check_resolved(backend, mesh)
    dtype = dtype or hf_kwargs.pop("torch_dtype", None)
    device = default_device()
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **hf_kwargs)
    num_experts = generic.num_experts(model, config)
    mesh.validate(dist.get_world_size(), num_experts)
    device_mesh = mesh.build(device.type)
    expert_range = mesh.expert_range(dist.get_rank(), num_experts)
    # One dispatcher for every MoE layer: dispatchers hold no per-layer state.
    dispatcher = make_dispatcher(
        backend.dispatcher, num_experts, device_mesh.get_group("ep"), backend.combine, backend.dispatch_chunks
    )
    generic.install(model, backend, lambda n: dispatcher, expert_range, device)
    plan = None if checkpoint is None else plan_rank_read(model, checkpoint, expert_range)
    if checkpoint is not None and plan is None:
        rules = disk_rules(config.model_type)
        log.warning(
            "model_type %r: checkpoint layout not known to the sliced reader (rules %s); Transformers "
            "loads the whole checkpoint on every rank, which then keeps its experts",
            config.model_type,
            ", ".join(rules.unknown) or "of the experts",
        )
        model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, config=config, **hf_kwargs)
        generic.install(model, backend, lambda n: dispatcher, expert_range, device)
        model.to(device)
    elif plan is None:  # a block at a time: the float32 draw never holds the whole rank's model
        materialize_random(model, device, seed, dtype)
    else:
        model.to_empty(device=device)
        init_nonpersistent_buffers(model)
        engine_state(model).checkpoint_read = load_rank_slice(model, checkpoint, plan, expert_range)
    if lora is not None:  # after the base weights, before FSDP2: adapters shard with their layer
        apply_lora(model, lora, seed)
    if dtype is not None:
        cast_like_transformers(model, dtype)
    model.tie_weights()
    if dist.get_world_size() > 1:
        apply_fsdp_generic(model, device_mesh)
    if mesh.ep > 1:
        _mark_expert_params(model, device_mesh)
    state = engine_state(model)
    state.mesh, state.device_mesh, state.expert_range = mesh, device_mesh, expert_range
    return model
