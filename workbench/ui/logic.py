"""Panel logic as plain functions: valid meshes, backend choices and why not, "auto" resolution.

The widgets in `workbench.ui.panels` only display what these return, so tests call them directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from workbench.backends import AUTO_ORDER, CHOICES, availability, pick_auto
from workbench.config import preset_config
from workbench.models.fused_ce import fused_ce_support
from workbench.parallel.mesh import MeshConfig, valid_meshes
from workbench.params import moe_layer_flags, num_experts, param_counts
from workbench.presets import PRESETS

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
        if not self.expert_ranges:
            return f"dp={m.dp} (no routed experts)"
        return f"dp={m.dp} x ep={m.ep} (edp={m.edp}): {self.experts_per_rank} experts per rank"


def mesh_options(world_size: int, experts: int) -> list[MeshOption]:
    """Every valid dp x ep mesh for this cluster size and expert count (ep must divide both)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if experts < 1:
        raise ValueError(f"the model has {experts} experts; an MoE model needs >= 1")
    out = []
    for mesh in valid_meshes(world_size, experts):
        ranges = tuple(mesh.expert_range(r, experts) for r in range(mesh.ep))
        out.append(MeshOption(mesh, experts // mesh.ep, ranges))
    return out


def model_mesh_options(world_size: int, hf_config: Any) -> list[MeshOption]:
    """The meshes for a model config, reading its family's expert-count field (dp only without experts)."""
    experts = num_experts(hf_config)
    if experts == 0 or not any(moe_layer_flags(hf_config)):  # e.g. DeepSeek-V3 cut to its dense first layers
        return [MeshOption(m, 0, ()) for m in valid_meshes(world_size, 1)]
    return mesh_options(world_size, experts)


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


def choice_status(
    field: str,
    value: str,
    rank_infos: Sequence[dict] | None = None,
    device_type: str = "cpu",
    world_size: int = 1,
    ep: int = 1,
) -> Choice:
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


def backend_choices(
    rank_infos: Sequence[dict] | None = None, device_type: str = "cpu", world_size: int = 1, ep: int = 1
) -> dict[str, list[Choice]]:
    """For every BackendConfig field, each choice with availability on every rank and the reason."""
    return {
        field: [choice_status(field, value, rank_infos, device_type, world_size, ep) for value in values]
        for field, values in CHOICES.items()
    }


def resolve_auto(
    field: str,
    rank_infos: Sequence[dict] | None = None,
    device_type: str = "cpu",
    world_size: int = 1,
    fp8: bool = False,
) -> str | None:
    """What "auto" becomes for `field` on these ranks: BackendConfig.resolve's own rule (with fp8's), or None."""
    if field not in AUTO_ORDER:
        return None

    def probe(f: str, value: str) -> tuple[bool, str]:
        found = choice_status(f, value, rank_infos, device_type, world_size)
        return found.available, found.reason

    return pick_auto(field, probe, world_size, fp8)


def fused_ce_choice(value: bool | str, hf_config: Any) -> tuple[bool, str]:
    """(whether the loss runs fused under BackendConfig.fused_ce=`value` for the model of `hf_config`, why not).

    BackendConfig.resolve's rule with the model's fused_ce_support: "auto" runs fused wherever the model allows it,
    True is refused where it does not (the run would stop with this reason), False never fuses. No model: as set.
    """
    if value is False:
        return False, ""
    can, why = fused_ce_support(hf_config) if hf_config is not None else (True, "")
    return can, why


def device_of(rank_infos: Sequence[dict] | None, default: str = "cpu") -> str:
    """ "cuda" if the ranks report CUDA devices, else `default`."""
    if rank_infos and all(str(i.get("device", "")).startswith("cuda") for i in rank_infos):
        return "cuda"
    return default if not rank_infos else "cpu"


def model_summary(cfg: Any) -> dict[str, Any]:
    """Layers, experts, top-k and parameter counts of a model config (for the ModelPanel)."""
    counts = param_counts(cfg)
    return {
        "model_type": getattr(cfg, "model_type", "?"),
        "layers": counts.layers,
        "hidden": cfg.hidden_size,
        "experts": counts.num_experts,
        "top_k": counts.top_k,
        "shared_experts": int(getattr(cfg, "n_shared_experts", 0) or 0),
        "params": counts.total,
        "active_params": counts.active,
        "params_b": counts.total / 1e9,
        "active_params_b": counts.active / 1e9,
    }


def format_params(n: int) -> str:
    """A parameter count as people write it: 30.5B, 3.35B, 262K."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


@dataclass(frozen=True)
class PresetOption:
    """One entry of the model picker: a preset with its family and parameter counts."""

    name: str
    family: str
    model_type: str
    total: int
    active: int
    source: str

    @property
    def label(self) -> str:
        origin = f", {self.source}" if self.source else ""
        return (
            f"{self.family} \u00b7 {self.name} ({format_params(self.total)} total, "
            f"{format_params(self.active)} active{origin})"
        )


def preset_options() -> list[PresetOption]:
    """Every preset, grouped by family (in PRESETS order), with total and active parameters."""
    families = list(dict.fromkeys(p.family for p in PRESETS.values()))
    out = []
    for family in families:
        for preset in (p for p in PRESETS.values() if p.family == family):
            counts = param_counts(preset_config(preset.name))
            out.append(PresetOption(preset.name, family, preset.model_type, counts.total, counts.active, preset.source))
    return out
