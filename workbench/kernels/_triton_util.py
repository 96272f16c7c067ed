"""Shared helpers for the Triton kernels: the device guard and launch sizing (what runs is backends' choice)."""

from __future__ import annotations

import os

import torch

from workbench.errors import BackendError


def triton_interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where Triton runs kernels on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_triton_device(x: torch.Tensor, kernel: str) -> None:
    """Raise BackendError (with what to do) unless `x` can run a Triton kernel."""
    if x.device.type == "cuda" or triton_interpreting():
        return
    raise BackendError(
        f"{kernel}='triton' cannot run here: {kernel}='triton' needs a CUDA device, got {x.device.type}; use 'torch'"
    )


def num_programs_for(device: torch.device, rows: int) -> int:
    """How many programs a row-looping kernel should launch: a few per SM, never more than rows."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return min(rows, 4 * sms)
    return min(rows, 4)
