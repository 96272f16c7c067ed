"""SwiGLU activation, silu(gate) * up, as Qwen3-MoE's experts and dense MLPs compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.errors import BackendError


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference SwiGLU: the eager ops Transformers runs (ACT2FN['silu'](gate) * up)."""
    return F.silu(gate) * up


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused Triton SwiGLU (CUDA; CPU only under TRITON_INTERPRET=1)."""
    from workbench.kernels import triton_swiglu

    return triton_swiglu.swiglu(gate, up)


def swiglu_packed_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference SwiGLU on a packed [..., 2I] = cat(gate, up) tensor."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_torch(gate, up)


def swiglu_packed_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused Triton SwiGLU on a packed [..., 2I] tensor; the gradient comes back packed too."""
    from workbench.kernels import triton_swiglu

    return triton_swiglu.swiglu_packed(gate_up)


def _impl(table: dict, backend: str):
    try:
        return table[backend]
    except KeyError:
        raise BackendError(f"unknown swiglu backend {backend!r}; choose one of {list(table)}") from None


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """silu(gate) * up with the chosen backend ("torch" or "triton")."""
    from workbench.kernels import SWIGLU_BACKENDS

    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape; got {tuple(gate.shape)} "
                         f"and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate and up must share a dtype; got {gate.dtype} and {up.dtype}")
    return _impl(SWIGLU_BACKENDS, backend)(gate, up)


def swiglu_packed(gate_up: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """SwiGLU for Qwen3-MoE's fused gate_up_proj output [..., 2I] (first half gate, second up)."""
    from workbench.kernels import SWIGLU_PACKED_BACKENDS

    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: last dim must be even (cat(gate, up)); got shape "
                         f"{tuple(gate_up.shape)}")
    return _impl(SWIGLU_PACKED_BACKENDS, backend)(gate_up)
