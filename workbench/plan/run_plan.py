"""plan_run: a RunConfig's predicted memory per rank and step time on a GPU kind and rank count, before any weight
exists (the model's config only: workbench.params, the memory parts, the FLOPs)."""

from __future__ import annotations

from typing import Any

import torch

from workbench.config import RunConfig
from workbench.plan.gpus import GIB, GPUS, RESERVE_GIB, gpu_kind, host_available_gib, spec_for
from workbench.plan.memory import memory_parts
from workbench.plan.options import fitting_options
from workbench.plan.report import Plan
from workbench.plan.shape import run_shape
from workbench.plan.step_time import step_time
from workbench.plan.throughputs import datasheet_throughputs, find_throughputs


def local_gpu() -> tuple[str, str | None, float]:
    """(kind, device name, memory GiB) of this process's device: its CUDA device, else the host ("cpu")."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return gpu_kind(props.name) or "h100", props.name, props.total_memory / GIB
    return "cpu", None, host_available_gib()


def _model_name(rc: RunConfig, hf_config: Any) -> str:
    name = rc.model.preset or rc.model.path
    return f"{name} ({hf_config.num_hidden_layers} layers)"


def plan_run(
    run_config: RunConfig,
    gpus: int | None = None,
    gpu: str | None = None,
    gpu_memory_gib: float | None = None,
    *,
    hf_config: Any = None,
    device_name: str | None = None,
    backend: Any = None,
    with_options: bool = True,
    use_calibration: bool = True,
) -> Plan:
    """The plan of `run_config` on `gpus` ranks (default: its mesh's dp, else 1) of kind `gpu` ("h100", "h200", "a100",
    "cpu", or a device name; default: this process's device). `gpu_memory_gib` overrides the device's memory (the
    host's available memory for "cpu"). `backend`: run_config.backend resolved for the device, where the caller has it
    (the trainer); options are planned only when the run does not fit. `use_calibration` False: the datasheet's
    throughputs even where `workbench bench --calibrate` saved this GPU's (the README's table)."""
    rc = run_config
    notes: list[str] = []
    if gpu is None:
        gpu, local_name, local_memory = local_gpu()
        device_name = device_name or local_name
        if gpu_memory_gib is None:
            gpu_memory_gib = local_memory
        if local_name and gpu_kind(local_name) is None:
            notes.append(f"{local_name} is not in the datasheet table: planned with h100's throughputs")
    spec = spec_for(gpu)
    kind = spec.kind
    if gpu_memory_gib is None:
        gpu_memory_gib = host_available_gib() if kind == "cpu" else spec.memory_gib
    gpus = gpus or (rc.mesh.dp if rc.mesh is not None else 1)
    hf_config = rc.model.hf_config() if hf_config is None else hf_config
    throughputs, note = find_throughputs(kind, device_name) if use_calibration else (datasheet_throughputs(kind), "")
    if note:
        notes.append(note)
    device_type = "cpu" if kind == "cpu" else "cuda"
    usable = gpu_memory_gib - (0.0 if kind == "cpu" else RESERVE_GIB)

    adapters: dict = {}  # LoraConfig -> its adapter count, shared by the options

    def evaluate(changed: RunConfig, n: int) -> tuple[float, bool, float]:
        shape = run_shape(changed, n, device_type, hf_config, adapters, backend)
        parts, time = memory_parts(shape), step_time(shape, throughputs)
        peak = parts.peak / GIB
        return peak, peak <= usable, time.tokens_per_s

    shape = run_shape(rc, gpus, device_type, hf_config, adapters, backend)
    parts = memory_parts(shape)
    time = step_time(shape, throughputs)
    peak = parts.peak / GIB
    fits = peak <= usable
    more_ranks = kind != "cpu"  # CPU ranks share one host's memory
    options = fitting_options(rc, gpus, hf_config, evaluate, more_ranks) if (with_options and not fits) else ()
    return Plan(
        model=_model_name(rc, hf_config),
        gpu=kind,
        gpus=gpus,
        dp=shape.dp,
        ep=shape.ep,
        capacity_gib=gpu_memory_gib,
        usable_gib=usable,
        parts=parts.as_gib(),
        peak_gib_per_rank=peak,
        fits=fits,
        step_s=time.step_s,
        tokens_per_s_per_gpu=time.tokens_per_s,
        time_parts=time.as_dict(),
        throughputs=throughputs.source,
        options=options,
        notes=tuple(notes),
    )


__all__ = ["GPUS", "plan_run"]
