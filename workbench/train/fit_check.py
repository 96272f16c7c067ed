"""The plan every run gets before anything is built (workbench.plan), and what the trainer does with it.

train.fit "check" (the default): a run planned not to fit its device's memory is refused with a ConfigError (exit code
2 on the command line) naming the `--set` changes that would fit; "auto": the fastest of them that keeps the training
and the rank count is applied to the RunConfig, and said; "off": no plan. The device is this rank's: a CUDA device's
name and memory, or on a CPU the host's available memory shared by the ranks on it; train.fit_memory_gib overrides
the memory (a GPU shared with another job).

A run the plan let through that still runs out of CUDA memory in a step stops with OutOfMemoryStop: the measured peak
beside the plan, and the options re-planned for a budget shrunk by the plan's own miss.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from workbench.config import RunConfig
from workbench.config_checks import ConfigError
from workbench.plan import Plan, auto_option, plan_run
from workbench.plan.gpus import GIB, gpu_kind, host_available_gib


class DoesNotFitError(ConfigError):
    """A run planned not to fit its device's memory, refused before any weight is allocated."""


class OutOfMemoryStop(RuntimeError):
    """A step ran out of CUDA memory that the plan had let through: the measured peak and the changes that would fit."""


def device_budget(device: torch.device, world: int) -> tuple[str, str | None, float]:
    """(GPU kind, device name, memory GiB one rank may plan with) for this rank's device."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return gpu_kind(props.name) or "h100", props.name, props.total_memory / GIB
    ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return "cpu", None, host_available_gib() / max(ranks_here, 1)


def plan_for_device(
    rc: RunConfig, world: int, hf_config: Any, device: torch.device, backend: Any, memory_gib: float | None = None
) -> Plan:
    """The plan of `rc` on `world` ranks of this kind of device (its memory, or `memory_gib`); `backend`: rc.backend
    resolved for the device (workbench.train.world_checks)."""
    kind, name, memory = device_budget(device, world)
    if memory_gib is None:
        memory_gib = rc.train.fit_memory_gib
    return plan_run(
        rc,
        gpus=world,
        gpu=kind,
        gpu_memory_gib=memory if memory_gib is None else memory_gib,
        hf_config=hf_config,
        device_name=name,
        backend=backend,
    )


def fit_run(
    rc: RunConfig, world: int, hf_config: Any, device: torch.device, backend: Any
) -> tuple[RunConfig, Plan | None]:
    """`rc` as it will run (train.fit auto's change applied) and its plan; DoesNotFitError where it cannot fit."""
    if rc.train.fit == "off":
        return rc, None
    try:
        plan = plan_for_device(rc, world, hf_config, device, backend)
    except (AttributeError, KeyError, TypeError, NotImplementedError) as err:
        # a config the counters cannot read (a family's field they do not know): the run goes on unplanned, said once
        if int(os.environ.get("RANK", "0") or 0) == 0:
            print(
                f"workbench: no plan for this model ({type(err).__name__}: {err}); building without the memory check",
                file=sys.stderr,
                flush=True,
            )
        return rc, None
    if plan.fits:
        return rc, plan
    if rc.train.fit == "auto":
        option = auto_option(plan.options, world)
        if option is not None:
            fitted = rc.with_overrides(option.change)
            if int(os.environ.get("RANK", "0") or 0) == 0:
                print(
                    f"workbench: train.fit auto: the run is planned at {plan.peak_gib_per_rank:.1f} GiB per rank of "
                    f"{plan.usable_gib:.1f} usable; applying {option.flags(world)} ({option.peak_gib_per_rank:.1f} "
                    f"GiB, {option.tokens_per_s_per_gpu:,.0f} tokens/s/GPU planned)",
                    file=sys.stderr,
                    flush=True,
                )
            return fitted, plan_for_device(fitted, world, hf_config, device, backend)
    raise DoesNotFitError(plan.refusal())


def out_of_memory_stop(
    rc: RunConfig, world: int, hf_config: Any, device: torch.device, backend: Any, step: int
) -> OutOfMemoryStop:
    """The error a step's CUDA out-of-memory becomes: the measured peak against the plan, and the options re-planned
    for the budget the plan's miss implies (its capacity x planned / measured)."""
    measured = torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else 0.0
    plan = plan_for_device(rc, world, hf_config, device, backend)
    text = (
        f"CUDA out of memory in step {step}: {measured:.1f} GiB allocated at the peak, "
        f"planned {plan.peak_gib_per_rank:.1f} of {plan.usable_gib:.1f} usable"
    )
    if measured > 0:
        shrunk = plan.capacity_gib * min(plan.peak_gib_per_rank / measured, 1.0) * 0.95
        tighter = plan_for_device(rc, world, hf_config, device, backend, memory_gib=shrunk)
        fixes = [o for o in tighter.options if o.fits][:4]
        if fixes:
            text += "; try: " + "; or ".join(o.flags(world) for o in fixes)
    return OutOfMemoryStop(text)
