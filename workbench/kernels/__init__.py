"""Kernels behind BackendConfig: RMSNorm, SwiGLU and (fused) linear cross-entropy.

Each kernel has a torch reference that runs anywhere; the registries below map a backend name
to its implementation, and `get_*` check that the backend can run on a device first.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Mapping

import torch

from workbench.errors import BackendError
from workbench.kernels.cross_entropy import (
    fused_linear_cross_entropy,
    linear_cross_entropy,
    shift_labels,
)
from workbench.kernels.rms_norm import RMSNorm, rms_norm, rms_norm_te, rms_norm_torch, rms_norm_triton
from workbench.kernels.swiglu import (
    swiglu,
    swiglu_packed,
    swiglu_packed_torch,
    swiglu_packed_triton,
    swiglu_torch,
    swiglu_triton,
)

RMS_NORM_BACKENDS: Mapping[str, Callable] = MappingProxyType(
    {"torch": rms_norm_torch, "triton": rms_norm_triton, "te": rms_norm_te})
SWIGLU_BACKENDS: Mapping[str, Callable] = MappingProxyType(
    {"torch": swiglu_torch, "triton": swiglu_triton})
SWIGLU_PACKED_BACKENDS: Mapping[str, Callable] = MappingProxyType(
    {"torch": swiglu_packed_torch, "triton": swiglu_packed_triton})
# BackendConfig.fused_ce: False -> "unfused", True -> "chunked"
CROSS_ENTROPY_BACKENDS: Mapping[str, Callable] = MappingProxyType(
    {"unfused": linear_cross_entropy, "chunked": fused_linear_cross_entropy})


def _checked(kernel: str, table: Mapping[str, Callable], backend: str,
             device: torch.device | str | None) -> Callable:
    if backend not in table:
        raise BackendError(f"unknown {kernel} backend {backend!r}; choose one of {list(table)} "
                           "(resolve 'auto' with BackendConfig.resolve first)")
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    why = None
    if backend == "triton":
        from workbench.kernels._triton_util import triton_device_error

        why = triton_device_error(kernel, device)
    elif backend == "te":
        from workbench.kernels import te_common

        try:
            te_common.import_te(kernel)
        except BackendError as err:
            why = str(err)
        else:
            why = None if device.type == "cuda" else f"TransformerEngine needs a CUDA device, got {device.type}"
    if why is not None:
        raise BackendError(f"{kernel}={backend!r} cannot run here: {why}")
    return table[backend]


def get_rms_norm(backend: str, device: torch.device | str | None = None) -> Callable:
    """The rms_norm(x, weight, eps) implementation for `backend`, checked for `device`."""
    return _checked("rms_norm", RMS_NORM_BACKENDS, backend, device)


def get_swiglu(backend: str, device: torch.device | str | None = None) -> Callable:
    """The swiglu(gate, up) implementation for `backend`, checked for `device`."""
    return _checked("swiglu", SWIGLU_BACKENDS, backend, device)


def get_swiglu_packed(backend: str, device: torch.device | str | None = None) -> Callable:
    """The swiglu_packed(gate_up) implementation for `backend`, checked for `device`."""
    return _checked("swiglu", SWIGLU_PACKED_BACKENDS, backend, device)


def get_linear_cross_entropy(fused: bool) -> Callable:
    """lm_head + ForCausalLMLoss: the chunked fused version when `fused`, else the plain one."""
    if not isinstance(fused, bool):
        raise BackendError(f"fused must be True or False (BackendConfig.fused_ce); got {fused!r}")
    return CROSS_ENTROPY_BACKENDS["chunked" if fused else "unfused"]


__all__ = [
    "CROSS_ENTROPY_BACKENDS", "RMS_NORM_BACKENDS", "SWIGLU_BACKENDS", "SWIGLU_PACKED_BACKENDS",
    "RMSNorm", "fused_linear_cross_entropy", "get_linear_cross_entropy", "get_rms_norm",
    "get_swiglu", "get_swiglu_packed", "linear_cross_entropy", "rms_norm", "shift_labels",
    "swiglu", "swiglu_packed",
]
