"""RMSNorm equal to Transformers' Qwen3MoeRMSNorm, with torch, Triton and TransformerEngine paths.

`offset` 1.0 is the zero-centered variant (Qwen3.5-MoE's, Qwen3-Next's, Gemma's): scale (1 + weight), the weight
initialised to zeros, with those classes' numerics (the normalized value times (1 + weight) in float32, rounded once
to the input dtype).
"""

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


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Reference RMSNorm: the exact op sequence of Qwen3MoeRMSNorm, or with `offset` that of Qwen3_5MoeRMSNorm
    (runs anywhere)."""
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    if offset:
        # the zero-centered classes add the offset to the float32 weight and round the product once
        return (x32 * (offset + weight.float())).to(input_dtype)
    # HF rounds to the input dtype before the weight multiply; keep that so bf16 matches bit-for-bit.
    return weight * x32.to(input_dtype)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """Fused Triton forward+backward RMSNorm (CUDA; CPU only under TRITON_INTERPRET=1)."""
    return _triton_rms_norm().rms_norm(x, weight, eps, offset)


def rms_norm_te(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """TransformerEngine RMSNorm run on the caller's `weight` (CUDA + transformer_engine).

    TE's RMSNorm is y = x / sqrt(mean(x^2) + eps) * weight with zero_centered_gamma=False, i.e.
    Qwen3MoeRMSNorm's formula. TE only offers it as a module; a throwaway one is built on the
    meta device (no allocation, no init kernel) and given `weight` itself, not a functional_call
    swap: TE's backward reads the module's weight again, after a swap would have been undone.
    The autograd graph keeps the module alive until then.
    offset 1.0 is TE's zero_centered_gamma=True: y = x / sqrt(mean(x^2) + eps) * (1 + weight).
    """
    _check_te_offset(offset)
    te = te_common.import_te("rms_norm")
    te_common.check_cuda("rms_norm", x)
    norm = te.RMSNorm(weight.shape[0], eps=eps, zero_centered_gamma=bool(offset), device="meta", dtype=weight.dtype)
    # Straight into _parameters: `weight` may be a plain tensor (functional callers) or an FSDP2
    # unsharded parameter; TE's forward passes module.parameters() to its autograd function, so
    # the gradient lands on this very tensor.
    norm._parameters["weight"] = weight
    return norm(x)


def _check_te_offset(offset: float) -> None:
    """TE's RMSNorm scales by weight or (1 + weight) (zero_centered_gamma), no other offset."""
    if offset not in (0.0, 1.0):
        raise ValueError(f"rms_norm='te' scales by weight or (1 + weight) only, got offset={offset}; use 'triton'")


RMS_NORM_BACKENDS = KernelRegistry("rms_norm", {"torch": rms_norm_torch, "triton": rms_norm_triton, "te": rms_norm_te})


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "torch", offset: float = 0.0
) -> torch.Tensor:
    """RMSNorm over the last dim of `x` with the chosen backend ("torch", "triton", "te"), scale (offset + weight)."""
    _check_rms_norm_args(x, weight)
    return RMS_NORM_BACKENDS.impl(backend)(x, weight, eps, offset)


def _check_rms_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"rms_norm takes tensors; got x={type(x).__name__}, weight={type(weight).__name__}")
    if weight.dim() != 1 or x.dim() == 0 or x.shape[-1] != weight.shape[0]:
        raise ValueError(
            f"rms_norm: weight must be 1-D of size x.shape[-1]; got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )


def rms_norm_residual(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, backend: str = "torch", offset: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x), x) for a pre-norm block whose residual stream goes on from x.

    With backend 'triton' one autograd node returns both, and the residual's gradient is added to the norm's input
    gradient in the norm's backward kernel; elsewhere the two are the plain norm and x itself.
    """
    _check_rms_norm_args(x, weight)
    if backend == "triton":
        return _triton_rms_norm().rms_norm_residual(x, weight, eps, offset)
    return rms_norm(x, weight, eps, backend, offset), x


class RMSNorm(nn.Module):
    """Drop-in for Qwen3MoeRMSNorm (same `weight` parameter name) with a selectable backend; with offset=1.0 for the
    zero-centered norms (Qwen3_5MoeRMSNorm, Qwen3NextRMSNorm: scale 1 + weight, the weight initialised to zeros)."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        backend: str = "torch",
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        offset: float = 0.0,
    ) -> None:
        super().__init__()
        RMS_NORM_BACKENDS.impl(backend)  # an unknown name fails here, not at the first forward
        if not isinstance(hidden_size, int) or hidden_size <= 0:
            raise ValueError(f"RMSNorm hidden_size must be a positive int, got {hidden_size!r}")
        if not isinstance(offset, (int, float)) or isinstance(offset, bool):
            raise ValueError(f"RMSNorm offset must be a number (0.0, or 1.0 for a zero-centered norm), got {offset!r}")
        if backend == "te":
            _check_te_offset(offset)
        self.weight = nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps  # HF's attribute name, so code reading it keeps working
        self.backend = backend
        self.offset = float(offset)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The neutral scale: weight ones, or zeros where the offset already is one (as Transformers initialises
        the zero-centered classes)."""
        with torch.no_grad():
            self.weight.fill_(1.0 - self.offset)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Normalize the last dim, then scale by `offset + weight`."""
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, self.backend, self.offset)

    def forward_residual(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(self(hidden_states), hidden_states) with the residual's gradient summed in the norm (rms_norm_residual)."""
        return rms_norm_residual(hidden_states, self.weight, self.variance_epsilon, self.backend, self.offset)

    def extra_repr(self) -> str:
        offset = f", offset={self.offset}" if self.offset else ""
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}, backend={self.backend!r}{offset}"
