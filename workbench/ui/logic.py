"""Panel logic as plain functions: valid meshes, backend choices and why not, "auto" resolution.

The widgets in `workbench.ui.panels` only display what these return, so tests call them directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from workbench.backends import AUTO_ORDER, CHOICES, availability
from workbench.parallel.mesh import MeshConfig, valid_meshes

CUSTOM_CHECKPOINT = "local checkpoint"


@dataclass(frozen=True)
class MeshOption:
    """One dp x ep layout the user may pick, with what it means for the experts."""

    mesh: MeshConfig
    experts_per_rank: int
    expert_ranges: tuple[tuple[int, int], ...]  # [first, last) experts per ep rank

    @property
    def label(self) -> str:
        m = self.mesh
        return f"dp={m.dp} x ep={m.ep} (edp={m.edp}): {self.experts_per_rank} experts per rank"


def mesh_options(world_size: int, num_experts: int) -> list[MeshOption]:
    """Every valid dp x ep mesh for this cluster size and expert count (ep must divide both)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if num_experts < 1:
        raise ValueError(f"the model has {num_experts} experts; an MoE model needs >= 1")
    out = []
    for mesh in valid_meshes(world_size, num_experts):
        ranges = tuple(mesh.expert_range(r, num_experts) for r in range(mesh.ep))
        out.append(MeshOption(mesh, num_experts // mesh.ep, ranges))
    return out


@dataclass(frozen=True)
class Choice:
    """One backend choice for one field: can it run on every rank, and if not, why."""

    field: str
    value: str
    available: bool
    reason: str = ""


def _from_info(info: dict, field: str, value: str) -> tuple[bool, str] | None:
    entry = (info.get("backends") or {}).get(f"{field}.{value}")
    if entry is None:
        return None
    return bool(entry.get("available")), str(entry.get("reason") or "")


def choice_status(field: str, value: str, rank_infos: Sequence[dict] | None = None,
                  device_type: str = "cpu", world_size: int = 1, ep: int = 1) -> Choice:
    """Availability of `field=value` on all ranks (from `cluster.info()` records, else locally)."""
    if value == "auto":
        return Choice(field, value, True, "")
    if field == "dispatcher" and value == "local" and ep > 1:
        return Choice(field, value, False, f"'local' cannot serve expert parallelism (ep={ep}); use 'alltoall'")
    if not rank_infos:
        ok, reason = availability(field, value, device_type, world_size)
        return Choice(field, value, ok, reason)
    for info in rank_infos:
        found = _from_info(info, field, value)
        if found is None:  # a rank that did not report this choice: ask locally for its device
            device = "cuda" if str(info.get("device", "cpu")).startswith("cuda") else "cpu"
            found = availability(field, value, device, int(info.get("world_size", world_size)))
        ok, reason = found
        if not ok:
            return Choice(field, value, False, f"rank {info.get('rank', '?')}: {reason}")
    return Choice(field, value, True, "")


def backend_choices(rank_infos: Sequence[dict] | None = None, device_type: str = "cpu",
                    world_size: int = 1, ep: int = 1) -> dict[str, list[Choice]]:
    """For every BackendConfig field, each choice with availability on every rank and the reason."""
    return {field: [choice_status(field, value, rank_infos, device_type, world_size, ep) for value in values]
            for field, values in CHOICES.items()}


def resolve_auto(field: str, rank_infos: Sequence[dict] | None = None, device_type: str = "cpu",
                 world_size: int = 1) -> str | None:
    """What "auto" becomes for `field` on these ranks (BackendConfig.resolve's rule), or None."""
    if field not in AUTO_ORDER:
        return None
    order = AUTO_ORDER[field]
    if field == "dispatcher":
        order = ("alltoall",) if world_size > 1 else ("local",)
    for value in order:
        if choice_status(field, value, rank_infos, device_type, world_size).available:
            return value
    return None


def device_of(rank_infos: Sequence[dict] | None, default: str = "cpu") -> str:
    """"cuda" if the ranks report CUDA devices, else `default`."""
    if rank_infos and all(str(i.get("device", "")).startswith("cuda") for i in rank_infos):
        return "cuda"
    return default if not rank_infos else "cpu"


def model_summary(cfg: Any) -> dict[str, Any]:
    """Layers, experts, top-k and parameter counts of a model config (for the ModelPanel)."""
    from workbench.ui.memory import param_counts

    counts = param_counts(cfg)
    return {"model_type": getattr(cfg, "model_type", "?"), "layers": counts.layers,
            "hidden": cfg.hidden_size, "experts": counts.num_experts, "top_k": counts.top_k,
            "params_b": counts.total / 1e9, "active_params_b": counts.active / 1e9}
