"""GPT-OSS's experts with the fused Triton activation: biases and the clamped, interleaved SwiGLU.

Transformers' path on expert-major rows materializes the repeated [N, 2I] and [N, H] biases
(repeat_interleave, whose backward is an atomic index_add), then runs _apply_gate as ~8 kernels
that save ~3x the GEMM output for backward. Here: the up GEMM, one fused bias+gate kernel that
saves only the GEMM output, the down GEMM, and an in-place bias add. Same math as Transformers.
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.kernels.gpt_oss_gate import add_row_bias, gpt_oss_gate, row_segments
from workbench.moe.hf_experts import expert_linear, expert_offsets

# Shape suffixes: N routed rows, D hidden.


def is_gpt_oss_gate(module: nn.Module) -> bool:
    """Whether `module` computes GPT-OSS's gate: GptOssExperts's own `_apply_gate`, alpha/limit, biased fused layout.

    Read from the class, not the model type: a subclass with another gate, or a future family
    reusing the name with another layout, keeps the family's own code.
    """
    try:
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
    except ImportError:
        return False
    if getattr(type(module), "_apply_gate", None) is not GptOssExperts._apply_gate:
        return False
    if not all(isinstance(getattr(module, a, None), (int, float)) for a in ("alpha", "limit")):
        return False
    # the layout the kernel assumes: transposed [E, H, 2I] weights, interleaved gate/up, biases, no norm
    return (
        bool(getattr(module, "has_bias", False))
        and not getattr(module, "is_concatenated", True)
        and bool(getattr(module, "is_transposed", False))
        and not getattr(module, "has_post_expert_norm", False)
        and getattr(module, "gate_up_proj_bias", None) is not None
    )


def gpt_oss_expert_rows(
    module: nn.Module, x_ND: torch.Tensor, tokens_per_expert: torch.Tensor, kernel: str = "triton"
) -> torch.Tensor:
    """GPT-OSS experts on expert-major rows with the `kernel` ("torch" or "triton") bias and gate."""
    seg = row_segments(tokens_per_expert, x_ND.shape[0])
    offsets = expert_offsets(module, tokens_per_expert)  # one cumsum for both GEMMs and their adapters
    h = expert_linear(module, "gate_up_proj", x_ND, tokens_per_expert, offsets)  # with its LoRA rows, if any
    act = gpt_oss_gate(h, module.gate_up_proj_bias, seg, module.alpha, module.limit, backend=kernel)
    y = expert_linear(module, "down_proj", act, tokens_per_expert, offsets)
    return add_row_bias(y, module.down_proj_bias, seg, backend=kernel)
