"""Build the model a RunConfig asks for: the engine's model (sharded over a mesh) or vanilla HF."""

from __future__ import annotations

from typing import Any

import torch

from workbench.config_checks import ConfigError
from workbench.devices import resolve_dtype_name
from workbench.models.auto import AutoModelForCausalLM as EngineAuto
from workbench.models.cast import cast_like_transformers
from workbench.models.generic import has_fused_experts
from workbench.models.lora_check import check_lora_targets
from workbench.models.mesh_choice import resolve_mesh as resolve_mesh  # where the trainer's callers import it from


def model_dtype(settings, device: torch.device) -> torch.dtype:
    """`settings.dtype` (a ModelConfig's or BenchConfig's) as the torch dtype built on `device` (resolve_dtype_name)."""
    return getattr(torch, resolve_dtype_name(settings.dtype, device.type))


def check_lora(rc, hf_config: Any) -> None:
    """Refuse rc.lora on a model without the engine's experts, or naming a target the model lacks (meta model only)."""
    if getattr(rc, "lora", None) is None:
        return
    if not has_fused_experts(hf_config):
        raise ConfigError(
            f"lora runs on the engine's path; model_type {hf_config.model_type!r} has no v5 fused "
            "experts (a dense model): drop the lora section"
        )
    check_lora_targets(hf_config, rc.lora)


def build_model(
    rc, hf_config: Any, mesh: Any, device: torch.device, dtype: torch.dtype, backend=None
) -> torch.nn.Module:
    """The engine's model, or vanilla Transformers for a model without fused experts; sharded over `mesh`.

    Every model built with a mesh is FSDP2-sharded over dp (workbench.models.mesh_build), so more
    than one rank always means synchronized data parallelism. `backend`: rc.backend as the trainer
    resolved it for this device and mesh (resolving a resolved config again changes nothing).
    """
    lora = getattr(rc, "lora", None)
    # LoRA: the adapters are seeded by train.seed on every path (the base weights as before).
    lora_kwargs = {"lora": lora, "seed": rc.train.seed} if lora is not None else {}
    if rc.model.path is not None:
        model = EngineAuto.from_pretrained(
            rc.model.path,
            backend=backend or rc.backend,
            mesh=mesh,
            device=device,
            config=hf_config,
            dtype=dtype,
            **lora_kwargs,
        )
    else:
        extra = {"seed": rc.train.seed}  # seeded builds give the same weights on any world size
        extra.update(lora_kwargs)
        model = EngineAuto.from_config(
            hf_config, backend=backend or rc.backend, mesh=mesh, device=device, dtype=dtype, **extra
        )
    if mesh is None:
        model = cast_like_transformers(model.to(device=device), dtype)
    return model
