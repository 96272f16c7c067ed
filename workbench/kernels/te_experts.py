"""experts='te': TransformerEngine GroupedLinear GEMMs on the engine's fused expert weights.

moe/hf_experts.py runs the experts with it (gate, biases and FP8 padding there). The weights stay
the family's: e.g. `gate_up_proj` [E, 2I, H] and `down_proj` [E, H, I] are unbound
into per-expert views and handed to TE's GroupedLinear for one call, so parameter names, layouts,
checkpoints and FSDP2 sharding do not change, and TE's per-expert weight gradients flow back into
the fused tensors through a single UnbindBackward (one stack, not one full-size zero tensor per
expert as separate index views would give).

Speed (H200, Qwen3-30B-A3B expert shapes): torch grouped_mm runs these GEMMs in 2.31 ms, TE
GroupedLinear in 7.44 ms, so experts='auto' keeps grouped_mm first; 'te' is for comparison and
for FP8 (BackendConfig.fp8).
"""

from __future__ import annotations

import functools

import torch

from workbench.kernels import te_common

# Shape suffixes: E experts, N routed rows, K in features, M out features.

# FP8 GEMMs need every expert's row count to be a multiple of this (TE pads with Fp8Padding).
FP8_ROW_ALIGN = 16


@functools.lru_cache(maxsize=32)
def _grouped_linear_shell(num_gemms: int, in_features: int, out_features: int, dtype: torch.dtype):
    """A weightless te.GroupedLinear of this shape: its meta placeholders are replaced per call.

    Cached because building one registers `num_gemms` parameters (milliseconds at 128 experts,
    twice per MoE layer per step). Sharing it is safe: between calls it holds no tensor of ours,
    and with no FP8 or with current-scaling FP8 (te_common.fp8_autocast) no scaling state either.
    """
    te = te_common.import_te("experts")
    return te.GroupedLinear(
        num_gemms, in_features, out_features, bias=False, params_dtype=dtype, device="meta", use_grouped_tensor=False
    )


def grouped_linear_te(x_NK: torch.Tensor, counts: list[int], weight_EMK: torch.Tensor) -> torch.Tensor:
    """Rows of expert e (counts[e] of them, expert-major) times weight_EMK[e].T, via TE.

    `weight_EMK` keeps its autograd history: the gradient TE computes for each expert's slice
    accumulates into it. `counts` are host ints (TE's split-quantize path splits on the host).
    """
    num_experts, out_features, in_features = weight_EMK.shape
    shell = _grouped_linear_shell(num_experts, in_features, out_features, weight_EMK.dtype)
    views = {f"weight{e}": w for e, w in enumerate(weight_EMK.unbind(0))}
    # functional_call puts the views in place of the meta placeholders for this call only; TE's
    # backward uses the tensors its autograd function saved, never the module's attributes.
    return torch.func.functional_call(shell, views, (x_NK, counts))
