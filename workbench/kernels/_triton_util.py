"""Shared helpers for the Triton kernels: device checks and launch sizing."""

from __future__ import annotations

import os

import torch

from workbench.errors import INSTALL_HINT, BackendError


def triton_interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where Triton runs kernels on CPU tensors (tests only)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_runs_on(x: torch.Tensor) -> bool:
    """Whether the engine's Triton kernels take `x`: CUDA tensors, or CPU ones in the interpreter."""
    if not (x.is_cuda or (triton_interpreting() and x.device.type == "cpu")):
        return False
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def check_triton_device(x: torch.Tensor, kernel: str) -> None:
    """Raise BackendError (with what to do) unless `x` can run a Triton kernel."""
    if x.device.type == "cuda" or triton_interpreting():
        return
    raise BackendError(f"{kernel}='triton' cannot run here: {kernel}='triton' needs a CUDA device, got "
                       f"{x.device.type}; use 'torch'")


def triton_device_error(kernel: str, device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` (None where they can): CUDA + triton, or the interpreter."""
    import importlib.util

    if not (device.type == "cuda" or (device.type == "cpu" and triton_interpreting())):
        return f"{kernel}='triton' needs a CUDA device, got {device.type}; use 'torch'"
    if importlib.util.find_spec("triton") is None:
        return f"triton is not installed: {INSTALL_HINT['triton']}"
    return None


def num_programs_for(device: torch.device, rows: int) -> int:
    """How many programs a row-looping kernel should launch: a few per SM, never more than rows."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return min(rows, 4 * sms)
    return min(rows, 4)
