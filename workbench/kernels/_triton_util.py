"""Shared helpers for the Triton kernels: device checks and launch sizing."""

from __future__ import annotations

import os

import torch

from workbench.backends import BackendError, availability


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
    ok, why = availability(kernel, "triton", x.device)
    raise BackendError(f"{kernel}='triton' cannot run here: {why}")


def num_programs_for(device: torch.device, rows: int) -> int:
    """How many programs a row-looping kernel should launch: a few per SM, never more than rows."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return min(rows, 4 * sms)
    return min(rows, 4)
