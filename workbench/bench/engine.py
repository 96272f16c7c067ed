"""The engine variant: workbench.AutoModelForCausalLM loaded from the anchor's initial weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
import torch.distributed as dist

from workbench.backends import BackendConfig
from workbench.bench.anchor import family_losses
from workbench.bench.config import VariantSpec
from workbench.bench.tokens import label_count
from workbench.bench.variant import Prepared, adamw
from workbench.train.optim import describe_optimizer
from workbench.train.precision import resolve_precision


def variant_backend(spec: VariantSpec, backend: BackendConfig) -> BackendConfig:
    """The launch's engine backends with this variant's gate and overrides applied."""
    return dataclasses.replace(backend, gate=spec.gate, **dict(spec.backend))


def build_engine(spec: VariantSpec, checkpoint: Path, backend: BackendConfig, mesh, lr: float, rows_per_rank: int,
                 seq: int, device: torch.device, dtype: torch.dtype, precision: str = "auto",
                 seed: int = 0) -> Prepared:
    """The engine sharded over `mesh`, its loss normalized by the global token count; AdamW in `precision`."""
    import workbench

    backend = variant_backend(spec, backend)
    model = workbench.AutoModelForCausalLM.from_pretrained(checkpoint, backend=backend, mesh=mesh, dtype=dtype)
    model.train()
    world = dist.get_world_size()
    # Gradients are summed over ranks (FSDP divide factor 1): each rank's loss is its token sum
    # over the GLOBAL count, so the per-rank losses add up to the global mean.
    num_items = torch.tensor(float(label_count(rows_per_rank * world, seq)), device=device)
    # The family's own aux loss, with the coefficient Transformers adds it with (0 where it has none).
    coef = float(getattr(model.config, "router_aux_loss_coef", 0.0) or 0.0)
    # The anchor's convention (FSDP-averaged grads of each rank's local mean incl. its local aux):
    # the engine's aux is that of this rank's rows (no `aux_loss_group`, whose global statistic is
    # the Trainer's, not the anchor's) and its share of the mean over ranks is aux / world.
    aux_share = 1.0 / world

    def forward(ids: torch.Tensor):
        out = model(input_ids=ids, labels=ids, num_items_in_batch=num_items, output_router_logits=True,
                    use_cache=False)
        ce, aux = family_losses(out, coef)
        aux = aux * aux_share
        return ce + coef * aux, ce, aux

    resolved = model.workbench_backend.to_dict() if model.workbench_backend is not None else backend.to_dict()
    optimizer = adamw(model, lr, device, engine=True, precision=precision, seed=seed)
    setup = {
        "library": "workbench", "backend": resolved, "mesh": mesh.to_dict(), "gate": spec.gate,
        "path": "generic",
        "attention": getattr(model.config, "_attn_implementation", None),
        "aux_loss": f"{model.config.model_type}'s own, coef {coef:g} (per rank, as the anchor)",
        "fsdp": "workbench.models.mesh_build.apply_fsdp_generic (summed grads)" if world > 1 else "none (one rank)",
        "optimizer": describe_optimizer(optimizer), "activation_checkpointing": False, "dtype": str(dtype),
        "precision": resolve_precision(precision, model.parameters()),
    }
    return Prepared(model, optimizer, forward, "sum", setup)
