"""A run as the `workbench` command starts it: its config read and checked for the rank count before any rank starts
(`workbench finetune`), and finetune on each rank with the terminal progress bar on rank 0 (`workbench finetune`,
and `workbench demo`'s spawned ranks).

The cli modules import this one when a run starts (workbench.cli_common.run_command): it imports torch and the
trainer, which `workbench --help`, `workbench runs` and `workbench show` never need.
"""

from __future__ import annotations

import torch

from workbench.config import RunConfig
from workbench.parallel import dist_utils as du
from workbench.train.fit_check import fit_run
from workbench.train.loop import finetune
from workbench.train.world_checks import check_world
from workbench.ui.terminal_progress import ProgressBar


def checked_config(path: str, overrides: dict, world: int) -> RunConfig:
    """The RunConfig of YAML file `path` with `overrides`, refused (ConfigError, ValueError, TypeError) unless it runs
    on `world` ranks: the trainer's own checks of the rank count (workbench.train.world_checks), made here so a
    mistake is one line from this process instead of a traceback per rank."""
    rc = RunConfig.from_yaml(path)
    if overrides:
        rc = rc.with_overrides(overrides)
    return checked_for_world(rc, world)


def checked_for_world(rc: RunConfig, world: int) -> RunConfig:
    """`rc` refused (ConfigError, ValueError, TypeError) unless it runs on `world` ranks and fits their memory; the
    config a rank then trains (train.fit auto's change applied)."""
    hf_config, device = rc.model.hf_config(), du.pick_device(rc.model.device)
    checked = check_world(rc, world, hf_config, device)
    return fit_run(rc, world, hf_config, device, checked.backend)[0]  # a run that cannot fit: refused here


def run_rank(rc: RunConfig, bar: bool, callbacks: tuple = ()) -> dict | None:
    """finetune(rc) on this rank, with the terminal progress bar on rank 0 when `bar`; its result on rank 0, else
    None."""
    rank0 = du.rank() == 0
    result = finetune(rc, callbacks=[*([ProgressBar()] if rank0 and bar else []), *callbacks])
    return result if rank0 else None


def demo_world(ranks: int | None) -> tuple[int, str]:
    """`workbench demo`'s rank count (`ranks`, else every local GPU, else 2 CPU ranks) and where they run."""
    cuda = torch.cuda.is_available()
    return ranks or (torch.cuda.device_count() if cuda else 2), "GPU" if cuda else "CPU (gloo)"


def demo_config(overrides: dict) -> RunConfig:
    """The demo's RunConfig (the embedded tiny MoE) with `overrides`."""
    return RunConfig.demo().with_overrides(overrides)


def demo_rank(payload: dict, callbacks: tuple = ()) -> None:
    """What each spawned demo rank runs: {"config": RunConfig dict, "bar": rank 0 draws a progress bar}."""
    run_rank(RunConfig.from_dict(payload["config"]), payload["bar"], callbacks)
