"""Grouped weight gradients with their sums of squares: the Triton kernel where it runs, a torch reference.

out[e] = a[rows of e]^T @ b[rows of e] for expert-major rows (`offsets_E`: each expert's end row), with the float32
Σ out² of the stored values (what the trainer's clipping norm would read out again for). The reference loops over
the experts on the host (one sync): tests and machines without the kernel.
"""

from __future__ import annotations

import torch

# Shape suffixes: T rows (expert-major tokens), E experts, M and N the weight gradient's two dims.


def grouped_wgrad_torch(
    a_TM: torch.Tensor, b_TN: torch.Tensor, offsets_E: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [E, M, N], Σ out² per expert) by a loop over the experts, products summed in float32."""
    experts = offsets_E.shape[0]
    out_EMN = a_TM.new_empty(experts, a_TM.shape[1], b_TN.shape[1])
    start = 0
    for e, end in enumerate(offsets_E.tolist()):
        out_EMN[e] = (a_TM[start:end].t().float() @ b_TN[start:end].float()).to(out_EMN.dtype)
        start = end
    return out_EMN, out_EMN.float().square().sum(dim=(1, 2))


def _triton_grouped_wgrad():
    """workbench.kernels.triton_grouped_wgrad, None without triton (the reference runs). Imported on first use:
    Triton is optional, and it reads TRITON_INTERPRET when it is imported."""
    try:
        import workbench.kernels.triton_grouped_wgrad as kernels
    except ImportError:
        return None
    return kernels


def triton_takes(dtype: torch.dtype, device: torch.device, m: int, n: int) -> bool:
    """Whether the Triton kernel computes [E, m, n] gradients from `dtype` rows on `device` (and triton imports)."""
    kernels = _triton_grouped_wgrad()
    return kernels is not None and kernels.supports(dtype, device, m, n)


def grouped_wgrad(a_TM: torch.Tensor, b_TN: torch.Tensor, offsets_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [E, M, N], the float32 partial sums of Σ out², in a fixed order): Triton where it takes them."""
    if a_TM.dtype == b_TN.dtype and triton_takes(a_TM.dtype, a_TM.device, a_TM.shape[1], b_TN.shape[1]):
        return _triton_grouped_wgrad().grouped_wgrad(a_TM, b_TN, offsets_E)
    return grouped_wgrad_torch(a_TM, b_TN, offsets_E)
