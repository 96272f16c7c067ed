"""`workbench.AutoModelForCausalLM`: Transformers' model whose fused experts are the engine's (the generic path)."""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
import transformers

from workbench.backends import BackendConfig
from workbench.devices import default_device
from workbench.errors import CheckpointError
from workbench.models import generic, save_model
from workbench.models.hf_io import check_model_folder
from workbench.models.lora import apply_lora
from workbench.models.lora_check import check_lora_targets
from workbench.models.mesh_build import (
    build_generic_parallel_model,
    check_mesh_call,
    check_mesh_for_model,
    shard_without_engine,
)
from workbench.models.meta_model import meta_model
from workbench.models.random_init import materialize_random
from workbench.models.sliced_load import plan_rank_read
from workbench.moe.dispatch import LocalDispatcher
from workbench.moe.hf_experts import check_generic_backend

log = logging.getLogger(__name__)


def _check_backend(backend) -> BackendConfig:
    if backend is None:
        return BackendConfig()
    if not isinstance(backend, BackendConfig):
        raise TypeError(
            f"backend must be a workbench.BackendConfig, got {type(backend).__name__}; "
            "e.g. backend=BackendConfig(experts='grouped_mm')"
        )
    return backend


def resolve_backend(backend: BackendConfig, mesh, device) -> BackendConfig:
    """The one resolution of `backend` for a build: this rank's device, and the mesh's ep (1 without a mesh).

    Every path (generic, vanilla) resolves here, before any model is built; the mesh builder takes
    the result as it is. On a mesh the model lives on the rank's own device.
    """
    return backend.resolve(build_device(mesh, device), world_size=1 if mesh is None else mesh.ep)


def build_device(mesh, device) -> torch.device:
    """Where the model will run: `device` (default_device() if unset), or with a mesh the rank's own device."""
    if mesh is None:
        return torch.device(device) if device is not None else default_device()
    check_mesh_call(mesh)
    rank_device = default_device()
    if device is not None and torch.device(device).type != rank_device.type:
        raise ValueError(
            f"device={device!r} with mesh=: a mesh's ranks build on their own device "
            f"({rank_device} for this process group); leave device unset"
        )
    return rank_device


def _start_vanilla(config, mesh) -> None:
    """Refuse a mesh a model without engine blocks cannot use (before building it), then say what it gets."""
    if mesh is not None:
        check_mesh_for_model(mesh, config)
    log.warning(
        "no fused experts in model_type=%r (no MoE Workbench engine path); loading vanilla Transformers%s",
        getattr(config, "model_type", None),
        " (FSDP2 data parallelism over the mesh, no expert parallelism)" if mesh is not None else "",
    )


def _vanilla_on_mesh(model, mesh):
    """A model without engine blocks: as Transformers built it, or FSDP2-sharded over the mesh's dp."""
    if mesh is None:
        return model
    return shard_without_engine(model, mesh)


def _generic_from(config, path, resolved: BackendConfig, mesh, device, hf_kwargs: dict, lora=None):
    """The generic engine path: Transformers' model whose fused experts modules are the engine's."""
    generic.validate_config(config)
    check_generic_backend(resolved.experts)
    if lora is not None:
        check_lora_targets(config, lora)  # a target the family lacks is refused before any weights exist
    if mesh is not None:
        return build_generic_parallel_model(config, resolved, mesh, checkpoint=path, lora=lora, **hf_kwargs)
    seed = hf_kwargs.pop("seed", None)
    if path is None and seed is not None:
        return _seeded_generic(config, resolved, device, seed, hf_kwargs, lora)
    if path is None:
        # On the device it was asked for: its backends were resolved for that device, and a GPU
        # initializes a 30B-class model in seconds where the CPU takes minutes.
        where = torch.device(device) if device is not None else contextlib.nullcontext()
        with torch.random.fork_rng(devices=[], enabled=seed is not None), where:
            if seed is not None:
                torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config, **hf_kwargs)
    else:
        # The engine's reader checks every tensor's header against the config first (as on a mesh): a
        # wrong shape is one error naming the tensor and its file, not Transformers' conversion report.
        twin = meta_model(config)
        plan_rank_read(twin, path, (0, generic.num_experts(twin, config)))
        try:
            model, info = transformers.AutoModelForCausalLM.from_pretrained(
                path, config=config, output_loading_info=True, **hf_kwargs
            )
        except RuntimeError as err:
            # A layout the engine's reader does not follow (quantized, rules it cannot read) reaches here.
            if not any(s in str(err) for s in ("mismatched", "size mismatch", "conversion of the weights")):
                raise
            raise CheckpointError(
                f"checkpoint {path} does not fit its config ({config.model_type}): some tensors have the "
                "wrong shape (e.g. missing experts); see the loading report above. Point to a complete "
                "checkpoint written by save_pretrained, or fix config.json"
            ) from err
        missing = sorted(info.get("missing_keys", []))
        mismatched = [str(m[0]) if isinstance(m, tuple) else str(m) for m in info.get("mismatched_keys", [])]
        if missing or mismatched:
            # Transformers would silently random-init these; a fine-tune from them would be garbage.
            raise CheckpointError(
                f"checkpoint {path} does not fit its config ({config.model_type}): missing "
                f"tensors {missing[:8]}{'...' if len(missing) > 8 else ''}; tensors of the wrong "
                f"shape (e.g. missing experts) {mismatched[:8]}. Point to a complete "
                "checkpoint written by save_pretrained, or fix config.json"
            )
    # The device `resolved` was resolved for: the experts' grouped_mm dtypes are decided for it.
    generic.install(model, resolved, lambda n: LocalDispatcher(n, resolved.combine), device=build_device(None, device))
    if lora is not None:
        apply_lora(model, lora, seed or 0)
    return model


def _seeded_generic(config, resolved: BackendConfig, device, seed: int, hf_kwargs: dict, lora=None):
    """A fresh model on one process, built and seeded as the mesh build does it (models/mesh_build.py).

    Meta build, then models.generic.init_random (seeded per module and per expert) on the device,
    in float32, then the cast, one decoder layer at a time (models/random_init.py): a seed gives the
    same weights on 1 rank as on any mesh, so the same run config starts from the same loss whatever
    the world size (Transformers' own init draws from one sequence, which a sharded build cannot
    reproduce).
    """
    dtype = hf_kwargs.pop("dtype", None) or hf_kwargs.pop("torch_dtype", None)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **hf_kwargs)
    generic.install(model, resolved, lambda n: LocalDispatcher(n, resolved.combine), device=build_device(None, device))
    # On `device` (the trainer's: where the mesh build would draw too), else the CPU, as Transformers builds;
    # a block at a time, so the float32 draw never holds the whole model (122 GB at 48 layers of 30B-A3B)
    materialize_random(model, torch.device(device) if device is not None else torch.device("cpu"), seed, dtype)
    if lora is not None:  # adapters drawn in float32 and stored in the base's dtype (models/lora.py)
        apply_lora(model, lora, seed)
    model.tie_weights()
    return model


def _refuse_vanilla_lora(config, lora) -> None:
    if lora is not None:
        raise ValueError(
            f"lora= runs on the engine's path; model_type {getattr(config, 'model_type', None)!r} has "
            "no v5 fused experts (a dense model): use PEFT on it directly"
        )


class AutoModelForCausalLM(transformers.AutoModelForCausalLM):
    """Drop-in for `transformers.AutoModelForCausalLM` whose MoE blocks are the engine's."""

    @classmethod
    def from_config(cls, config, backend: BackendConfig | None = None, mesh=None, device=None, lora=None, **hf_kwargs):
        """Build a randomly initialized model from a Transformers config (`lora`: a workbench LoraConfig)."""
        # Resolved once, with the mesh's ep, before anything is built; the builder takes it as it is.
        resolved = resolve_backend(_check_backend(backend), mesh, device)
        if generic.has_fused_experts(config):
            return _generic_from(config, None, resolved, mesh, device, hf_kwargs, lora)
        _refuse_vanilla_lora(config, lora)
        _start_vanilla(config, mesh)
        seed = hf_kwargs.pop("seed", None)  # the engine's mesh build takes one: same weights on every rank
        with torch.random.fork_rng(devices=[], enabled=seed is not None):
            if seed is not None:
                torch.manual_seed(seed)
            model = transformers.AutoModelForCausalLM.from_config(config, **hf_kwargs)
        return _vanilla_on_mesh(model, mesh)

    @classmethod
    def from_pretrained(
        cls,
        pretrained_model_name_or_path,
        *model_args,
        backend: BackendConfig | None = None,
        mesh=None,
        device=None,
        lora=None,
        **hf_kwargs,
    ):
        """Load a Transformers checkpoint (local directory) into the engine (`lora`: a workbench LoraConfig)."""
        resolved = resolve_backend(_check_backend(backend), mesh, device)
        path = Path(pretrained_model_name_or_path)
        check_model_folder(path)  # every path below reads only files inside it
        # A caller's config (e.g. the trainer's, with its overrides) wins over the directory's.
        config = hf_kwargs.pop("config", None) or transformers.AutoConfig.from_pretrained(path)
        if generic.has_fused_experts(config):
            return _generic_from(config, path, resolved, mesh, device, hf_kwargs, lora)
        _refuse_vanilla_lora(config, lora)
        _start_vanilla(config, mesh)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, *model_args, config=config, **hf_kwargs)
        return _vanilla_on_mesh(model, mesh)


def save_pretrained(model, out_dir, max_shard_size: str = "5GB") -> None:
    """Write the Transformers layout from any mesh; collective: every rank must call it."""
    save_model.save_pretrained(model, out_dir, max_shard_size)
