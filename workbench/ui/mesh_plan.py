"""The run plan (workbench.plan) of every mesh the Setup tab offers: predicted memory per rank and tokens/s per GPU
for each, and for a mesh that cannot fit, why (its largest parts) and what would (the plan's options). Pure functions
and HTML; the MeshPanel shows them and tests call them without a browser."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Any

from workbench.backends import BackendConfig
from workbench.config import ModelConfig, RunConfig
from workbench.config_checks import ConfigError
from workbench.config_data import DataConfig
from workbench.config_train import TrainConfig
from workbench.parallel.mesh import MeshConfig
from workbench.plan import Plan, plan_run
from workbench.plan.gpus import gpu_kind
from workbench.ui.logic import MeshOption


@dataclass(frozen=True)
class MeshPlan:
    """One mesh and its plan (None with the reason where the settings cannot run on it)."""

    option: MeshOption
    plan: Plan | None
    error: str | None = None
    run_config: RunConfig | None = None  # what was planned


def gib_text(gib: float) -> str:
    """A size as people read it: 0.57 GiB, 12.0 MiB, 42.3 GiB."""
    if gib >= 10:
        return f"{gib:.1f} GiB"
    if gib >= 0.01:
        return f"{gib:.2f} GiB"
    return f"{gib * 1024:.1f} MiB"


def training_run_config(training: dict[str, Any], dp: int, ep: int) -> RunConfig:
    """The RunConfig the Setup tab's training settings describe on a dp x ep mesh (synthetic data: the plan reads
    only the sequence length). The model section carries the dtype only: the plan is given the model's config."""
    return RunConfig(
        model=ModelConfig(preset="tiny", dtype=training.get("dtype", "auto")),
        mesh=MeshConfig(dp=dp, ep=ep) if dp > 1 else None,
        backend=BackendConfig(fused_ce=training.get("fused_ce", "auto")),  # "auto": the plan asks the model
        data=DataConfig(kind="synthetic", seq_len=training["seq_len"]),
        train=TrainConfig(
            local_batch_size=training["local_batch"],
            global_batch_size=training["local_batch"] * dp,
            activation_checkpointing=bool(training.get("activation_checkpointing", False)),
            optimizer_states=training.get("optimizer_states", "full"),
        ),
        lora=training.get("lora"),
    )


def mesh_plans(
    hf_config: Any,
    options: list[MeshOption],
    training: dict[str, Any],
    device_type: str,
    gpu_memory_gib: float | None = None,
    device_name: str | None = None,
) -> list[MeshPlan]:
    """The plan of each mesh for `training` (seq_len, local_batch, dtype, activation_checkpointing, fused_ce, lora,
    optimizer_states) on ranks of `device_type` with `gpu_memory_gib` each (None: the GPU kind's; h100's figures
    for a GPU the datasheet table lacks)."""
    kind = "cpu" if device_type != "cuda" else (gpu_kind(device_name or "") or "h100")
    out = []
    for option in options:
        dp, ep = option.mesh.dp, option.mesh.ep
        try:
            rc = training_run_config(training, dp, ep)
            plan = plan_run(
                rc, gpus=dp, gpu=kind, gpu_memory_gib=gpu_memory_gib, hf_config=hf_config, with_options=False
            )
        except (ConfigError, ValueError) as err:
            out.append(MeshPlan(option, None, str(err)))
            continue
        out.append(MeshPlan(option, plan, None, rc))
    return out


def why_not(plan: Plan) -> str:
    """Why a plan does not fit: its peak against the usable memory and its three largest parts."""
    big = sorted(plan.parts.items(), key=lambda kv: -kv[1])[:3]
    parts = ", ".join(f"{name.replace('_', ' ')} {gib_text(gib)}" for name, gib in big if gib > 0)
    return f"{gib_text(plan.peak_gib_per_rank)} > {gib_text(plan.usable_gib)} usable ({parts})"


def mesh_plans_html(plans: list[MeshPlan], chosen: MeshOption | None) -> str:
    """A table: each mesh's memory per rank, tokens/s per GPU and whether it fits (why not where it does not)."""
    rows = []
    for mp in plans:
        mark = " style='font-weight:bold'" if mp.option == chosen else ""
        mesh = f"dp={mp.option.mesh.dp} x ep={mp.option.mesh.ep}"
        if mp.plan is None:
            cells = f"<td colspan='3'>{html.escape(mp.error or '')}</td>"
        else:
            p = mp.plan
            verdict = (
                "fits" if p.fits else f"<span style='color:#b00020'>does not fit: {html.escape(why_not(p))}</span>"
            )
            cells = f"<td>{gib_text(p.peak_gib_per_rank)}</td><td>{p.tokens_per_s_per_gpu:,.0f}</td><td>{verdict}</td>"
        rows.append(f"<tr{mark}><td>{mesh}</td>{cells}</tr>")
    head = "<tr><th>mesh</th><th>memory per rank</th><th>tokens/s per GPU</th><th></th></tr>"
    source = next((mp.plan.throughputs for mp in plans if mp.plan is not None), "")
    return (
        f"<table>{head}{''.join(rows)}</table>"
        f"<small>predicted before anything is built (workbench plan; throughputs: {html.escape(source)})</small>"
    )


def chosen_plan_html(mp: MeshPlan, hf_config: Any) -> str:
    """The chosen mesh's parts, and for one that does not fit the plan's options for it (fastest first)."""
    if mp.plan is None or mp.run_config is None:
        return ""
    p = mp.plan
    parts = ", ".join(f"{name.replace('_', ' ')} {gib_text(gib)}" for name, gib in p.parts.items() if gib > 0)
    text = f"<small>per rank at the peak: {parts}</small>"
    if not p.fits:
        again = plan_run(mp.run_config, gpus=p.gpus, gpu=p.gpu, gpu_memory_gib=p.capacity_gib, hf_config=hf_config)
        fixes = sorted((o for o in again.options if o.fits), key=lambda o: o.gpus != p.gpus)[:3]
        if fixes:
            text += "<br><small>would fit with: " + "; ".join(html.escape(o.describe(p.gpus)) for o in fixes)
            text += "</small>"
    return text
