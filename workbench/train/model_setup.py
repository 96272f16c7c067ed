"""Build the model a RunConfig asks for: the engine's model (sharded over a mesh) or vanilla HF."""

from __future__ import annotations

from typing import Any

import torch

from workbench.config import ConfigError


def model_dtype(model_cfg, device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA and float32 on CPU for dtype="auto"."""
    if model_cfg.dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, model_cfg.dtype)


def _num_experts(hf_config: Any) -> int:
    return int(getattr(hf_config, "num_experts", None) or getattr(hf_config, "num_local_experts", 0) or 0)


def resolve_mesh(mesh: Any, world_size: int, hf_config: Any):
    """The MeshConfig to build, or None for one process.

    None in the RunConfig means: dp = world size, and ep = world size when it divides the expert
    count (else ep = 1). An explicit mesh is validated against the world and the model.
    """
    if mesh is None:
        if world_size == 1:
            return None
        try:
            from workbench.parallel.mesh import MeshConfig
        except ImportError:
            return None  # engine without parallel support yet: replicated data parallelism
        experts = _num_experts(hf_config)
        ep = world_size if experts and experts % world_size == 0 else 1
        mesh = MeshConfig(dp=world_size, ep=ep)
    try:
        mesh.validate(world_size, _num_experts(hf_config))
    except ValueError as err:
        raise ConfigError(f"mesh {mesh} does not fit this run: {err}") from err
    return mesh


def build_model(rc, hf_config: Any, mesh: Any, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The engine's model when workbench.models is importable, else vanilla Transformers."""
    try:
        from workbench.models.auto import AutoModelForCausalLM as EngineAuto
    except ImportError:
        EngineAuto = None
    if EngineAuto is not None:
        if rc.model.path is not None:
            model = EngineAuto.from_pretrained(rc.model.path, backend=rc.backend, mesh=mesh, device=device,
                                               config=hf_config, dtype=dtype)
        else:
            extra = {"seed": rc.train.seed} if mesh is not None else {}
            model = EngineAuto.from_config(hf_config, backend=rc.backend, mesh=mesh, device=device, dtype=dtype,
                                           **extra)
    else:
        if mesh is not None:
            raise ConfigError("a mesh needs workbench.parallel, which this install lacks")
        import transformers

        if rc.model.path is not None:
            model = transformers.AutoModelForCausalLM.from_pretrained(rc.model.path, config=hf_config, dtype=dtype)
        else:
            model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    if mesh is None:
        model = model.to(device=device, dtype=dtype)
    else:
        mark_expert_grad_groups(model, mesh)
    return model


def mark_expert_grad_groups(model: torch.nn.Module, mesh: Any) -> int:
    """Tag expert parameters so grad clipping sums their norm over the ep group too.

    Under expert parallelism each ep rank holds different experts and FSDP2 shards them only
    over the expert-data-parallel dim, so their DTensor mesh does not show the ep split.
    """
    device_mesh = getattr(model, "workbench_device_mesh", None)
    if device_mesh is None or getattr(mesh, "ep", 1) <= 1:
        return 0
    from workbench.moe.experts import GroupedExperts
    from workbench.train.optim import GRAD_NORM_GROUP_ATTR

    ep_group = device_mesh.get_group("ep")
    marked = 0
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            for param in module.parameters():
                setattr(param, GRAD_NORM_GROUP_ATTR, ep_group)
                marked += 1
    return marked
