"""Kernels behind BackendConfig: RMSNorm, SwiGLU, RoPE, the MoE combine, (fused) linear cross-entropy, AdamW.

Each kernel has a torch reference that runs anywhere. Which backend runs is decided once, by
workbench.backends (BackendConfig.resolve), and handed to the kernel by name; each kernel's
KernelRegistry maps that name to its implementation. Nothing here reads a config or decides a backend.
"""

from __future__ import annotations

from workbench.kernels.cross_entropy import (
    fused_linear_cross_entropy,
    linear_cross_entropy,
    shift_labels,
)
from workbench.kernels.registry import KernelRegistry
from workbench.kernels.rms_norm import (
    RMS_NORM_BACKENDS,
    RMSNorm,
    rms_norm,
    rms_norm_te,
    rms_norm_torch,
    rms_norm_triton,
)
from workbench.kernels.swiglu import (
    SWIGLU_BACKENDS,
    SWIGLU_PACKED_BACKENDS,
    swiglu,
    swiglu_packed,
    swiglu_packed_torch,
    swiglu_packed_triton,
    swiglu_torch,
    swiglu_triton,
)

__all__ = [
    "RMS_NORM_BACKENDS",
    "SWIGLU_BACKENDS",
    "SWIGLU_PACKED_BACKENDS",
    "KernelRegistry",
    "RMSNorm",
    "fused_linear_cross_entropy",
    "linear_cross_entropy",
    "rms_norm",
    "rms_norm_te",
    "rms_norm_torch",
    "rms_norm_triton",
    "shift_labels",
    "swiglu",
    "swiglu_packed",
    "swiglu_packed_torch",
    "swiglu_packed_triton",
    "swiglu_torch",
    "swiglu_triton",
]
