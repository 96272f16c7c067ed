"""SwiGLU activation, silu(gate) * up, as Qwen3-MoE's experts and dense MLPs compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.kernels.registry import KernelRegistry


def _triton_swiglu():
    """workbench.kernels.triton_swiglu, imported when a Triton path first runs: Triton is optional, and it reads
    TRITON_INTERPRET when it is imported."""
    import workbench.kernels.triton_swiglu as kernels

    return kernels


def swiglu_torch(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Reference SwiGLU: the eager ops Transformers runs (ACT2FN['silu'](gate) * up)."""
    return F.silu(gate) * up


def swiglu_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Fused Triton SwiGLU (CUDA; CPU only under TRITON_INTERPRET=1)."""
    return _triton_swiglu().swiglu(gate, up)


def swiglu_packed_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """Reference SwiGLU on a packed [..., 2I] = cat(gate, up) tensor."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu_torch(gate, up)


def swiglu_packed_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """Fused Triton SwiGLU on a packed [..., 2I] tensor; the gradient comes back packed too."""
    return _triton_swiglu().swiglu_packed(gate_up)


def swiglu_packed_weighted_torch(gate_up: torch.Tensor, weights_M: torch.Tensor) -> torch.Tensor:
    """Reference row-weighted SwiGLU: silu rounded as torch rounds it, then silu * up * weight rounded once."""
    gate, up = gate_up.chunk(2, dim=-1)
    compute = torch.promote_types(gate_up.dtype, torch.float32)
    product = F.silu(gate).to(compute) * up.to(compute) * weights_M.to(compute).unsqueeze(-1)
    return product.to(gate_up.dtype)


def swiglu_packed_weighted_triton(gate_up: torch.Tensor, weights_M: torch.Tensor) -> torch.Tensor:
    """Fused Triton row-weighted SwiGLU; its backward also sums each row's weight gradient."""
    return _triton_swiglu().swiglu_packed_weighted(gate_up, weights_M)


SWIGLU_BACKENDS = KernelRegistry("swiglu", {"torch": swiglu_torch, "triton": swiglu_triton})
SWIGLU_PACKED_BACKENDS = KernelRegistry("swiglu", {"torch": swiglu_packed_torch, "triton": swiglu_packed_triton})
SWIGLU_PACKED_WEIGHTED_BACKENDS = KernelRegistry(
    "swiglu", {"torch": swiglu_packed_weighted_torch, "triton": swiglu_packed_weighted_triton}
)


def swiglu(gate: torch.Tensor, up: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """silu(gate) * up with the chosen backend ("torch" or "triton")."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate and up must have the same shape; got {tuple(gate.shape)} and {tuple(up.shape)}")
    if gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate and up must share a dtype; got {gate.dtype} and {up.dtype}")
    return SWIGLU_BACKENDS.impl(backend)(gate, up)


def swiglu_packed(gate_up: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """SwiGLU for Qwen3-MoE's fused gate_up_proj output [..., 2I] (first half gate, second up)."""
    if gate_up.dim() == 0 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed: last dim must be even (cat(gate, up)); got shape {tuple(gate_up.shape)}")
    return SWIGLU_PACKED_BACKENDS.impl(backend)(gate_up)


def swiglu_packed_weighted(gate_up: torch.Tensor, weights_M: torch.Tensor, backend: str = "torch") -> torch.Tensor:
    """weights[m] * swiglu_packed(gate_up)[m] for rows [M, 2I] (the routing weights before the down projection)."""
    if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_packed_weighted: rows must be [M, 2I] (cat(gate, up)); got {tuple(gate_up.shape)}")
    if weights_M.shape != gate_up.shape[:1]:
        raise ValueError(
            f"swiglu_packed_weighted: one weight a row: {gate_up.shape[0]} rows, weights {tuple(weights_M.shape)}"
        )
    return SWIGLU_PACKED_WEIGHTED_BACKENDS.impl(backend)(gate_up, weights_M)
