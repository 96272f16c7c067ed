"""RMSNorm equal to Transformers' Qwen3MoeRMSNorm, with torch, Triton and TransformerEngine paths."""

from __future__ import annotations

import torch
from torch import nn

from workbench.kernels import te_common
from workbench.kernels.registry import KernelRegistry


def _triton_rms_norm():
    """workbench.kernels.triton_rms_norm, imported when a Triton path first runs: Triton is optional, and it reads
    TRITON_INTERPRET when it is imported."""
    import workbench.kernels.triton_rms_norm as kernels

    return kernels


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm: the exact op sequence of Qwen3MoeRMSNorm (runs anywhere)."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    # HF rounds to the input dtype before the weight multiply; keep that so bf16 matches bit-for-bit.
    return weight * x32.to(input_dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Fused Triton forward+backward RMSNorm (CUDA; CPU only under TRITON_INTERPRET=1)."""
    return _triton_rms_norm().rms_norm(x, weight, eps)


def rms_norm_te(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """TransformerEngine RMSNorm run on the caller's `weight` (CUDA + transformer_engine).

    TE's RMSNorm is y = x / sqrt(mean(x^2) + eps) * weight with zero_centered_gamma=False, i.e.
    Qwen3MoeRMSNorm's formula. TE only offers it as a module; a throwaway one is built on the
    meta device (no allocation, no init kernel) and given `weight` itself, not a functional_call
    swap: TE's backward reads the module's weight again, after a swap would have been undone.
    The autograd graph keeps the module alive until then.
    """
    te = te_common.import_te("rms_norm")
    te_common.check_cuda("rms_norm", x)
    norm = te.RMSNorm(weight.shape[0], eps=eps, zero_centered_gamma=False, device="meta", dtype=weight.dtype)
    # Straight into _parameters: `weight` may be a plain tensor (functional callers) or an FSDP2
    # unsharded parameter; TE's forward passes module.parameters() to its autograd function, so
    # the gradient lands on this very tensor.
    norm._parameters["weight"] = weight
    return norm(x)


RMS_NORM_BACKENDS = KernelRegistry("rms_norm", {"torch": rms_norm_torch, "triton": rms_norm_triton, "te": rms_norm_te})


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "torch") -> torch.Tensor:
    """RMSNorm over the last dim of `x` with the chosen backend ("torch", "triton", "te")."""
    _check_rms_norm_args(x, weight)
    return RMS_NORM_BACKENDS.impl(backend)(x, weight, eps)


def _check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm takes tensors; got x={type(x).__name__}, weight={type(weight).__name__}")
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: weight must be 1-D of size x.shape[-1]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )


def rms_norm_residual(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "torch"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x), x) for a pre-norm block whose residual stream goes on from x.

    With backend 'triton' one autograd node returns both, and the residual's gradient is added to the norm's input
    gradient in the norm's backward kernel; elsewhere the two are the plain norm and x itself.
    """
    _check_rms_norm_args(x, weight)
    if backend == "triton":
        return _triton_rms_norm().rms_norm_residual(x, weight, eps)
    return rms_norm(x, weight, eps, backend), x


class RMSNorm(nn.Module):
    """Drop-in for Qwen3MoeRMSNorm (same `weight` parameter name) with a selectable backend."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        backend: str = "torch",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        RMS_NORM_BACKENDS.impl(backend)  # an unknown name fails here, not at the first forward
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be a positive int, got {hidden_size!r}")
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps  # HF's attribute name, so code reading it keeps working
        self.backend = backend

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Normalize the last dim, then scale by `weight`."""
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.backend)

    def forward_residual(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(hidden_states), hidden_states) with the residual's gradient summed in the norm (rms_norm_residual)."""
        return rms_norm_residual(hidden_states, self.weight, self.variance_epsilon, self.backend)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, backend={self.backend!r}"
