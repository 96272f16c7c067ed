"""A fused expert weight applied to expert-major rows: torch's grouped GEMM where it takes the operands (the dtypes it
takes on a device, 16-byte rows), else a loop over the experts; the Triton weight gradient where asked for.

Used by the engine's experts (hf_experts) and by their LoRA adapters (lora_experts) alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.moe.expert_wgrad import grouped_linear_wgrad, wgrad_applies
from workbench.moe.grouped_mm import grouped_mm_op, weight_EKO

# Shape suffixes: E experts, N routed rows, D a row's width, K a GEMM's inner size; weight_EKN: [E, K in, N out].


def grouped_mm_dtypes(device: torch.device | str) -> tuple[torch.dtype, ...]:
    """The dtypes torch's grouped GEMM takes on `device`; () where it cannot run there. Asked once, at install."""
    device = torch.device(device)
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return ()
    if device.type == "cuda":
        # Its CUDA kernels take bf16 on sm >= 8.0 (other dtypes reach a fallback that syncs with the host).
        return (torch.bfloat16,) if torch.cuda.get_device_capability(device)[0] >= 8 else ()
    return (torch.float32, torch.bfloat16)


def grouped_mm_ok(x_ND: torch.Tensor, weight_EKN: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether torch's grouped GEMM takes these operands: a dtype of `dtypes` (grouped_mm_dtypes), 16-byte rows."""
    if x_ND.dtype not in dtypes or weight_EKN.dtype != x_ND.dtype:
        return False
    return all((w * x_ND.element_size()) % 16 == 0 for w in weight_EKN.shape[1:])


def row_offsets(tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """The int32 end offsets of each expert's rows, as grouped_mm takes them."""
    return torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)


def grouped_linear(
    x_ND: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    weight_E: torch.Tensor,
    transposed: bool,
    dtypes: tuple[torch.dtype, ...],
    offsets: torch.Tensor | None = None,
    wgrad: str = "autograd",
) -> torch.Tensor:
    """Rows of expert e times its weight, for expert-major rows (`tokens_per_expert` rows each).

    `dtypes`: what grouped_mm takes on the device (the module's plan.grouped_mm_dtypes; ()
    for experts='loop'); operands it does not take run the per-expert loop. `offsets`: the int32
    end offsets (`row_offsets`) where the caller shares them over several GEMMs of the same rows.
    `wgrad`: BackendConfig.expert_wgrad ('triton': the weight gradient with its squares, moe/expert_wgrad.py).
    """
    weight_EKN = weight_EKO(weight_E, transposed)
    if grouped_mm_ok(x_ND, weight_EKN, dtypes):
        offsets = row_offsets(tokens_per_expert) if offsets is None else offsets
        if wgrad == "triton" and wgrad_applies(x_ND, weight_E):
            return grouped_linear_wgrad(x_ND, weight_E, offsets, transposed)
        return grouped_mm_op()(x_ND, weight_EKN, offs=offsets)
    outputs, start = [], 0
    for e, count in enumerate(tokens_per_expert.tolist()):  # the always-correct path (one host sync)
        if count:
            outputs.append(x_ND[start : start + count] @ weight_EKN[e])
            start += count
    if not outputs:
        # Keep the weight in the graph so every rank's backward reaches the same parameters.
        return x_ND.new_zeros(x_ND.shape[0], weight_EKN.shape[-1]) + 0.0 * weight_EKN.sum()
    return torch.cat(outputs, dim=0)
