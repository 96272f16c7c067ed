"""What the engine's attention classes (Qwen3-MoE's and GPT-OSS's fused RoPE, DeepSeek-V3's fused MLA q/k/v) share.

Each runs its own training forward only where it stands for Transformers' exactly: rope='triton', no KV cache
and no extra positional arguments; and it calls the attention function Transformers' own forward would call.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import ModuleType

import torch
from torch import nn

from workbench.kernels.rms_norm import RMSNorm
from workbench.models.qkv_projection import qkv_projection

# Shape suffixes: B batch, H heads, S sequence, D head dim.


class EngineAttention:
    """Mixin of the engine's attention classes (put in front of Transformers' own by a class swap)."""

    rope: str = "torch"  # the resolved BackendConfig.rope it was installed with ('torch': Transformers' forward)


def engine_forward_applies(module: EngineAttention, args: tuple, kwargs: dict) -> bool:
    """Whether `module` (an engine attention) runs its own forward: rope='triton', no cache, no positional extras."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    return not args and cache is None and module.rope == "triton"


def attention_function(family: ModuleType, impl: str) -> Callable:
    """The attention function of `impl` as the family's modeling module looks it up (5.17 and 5.2x registries)."""
    registry = family.ALL_ATTENTION_FUNCTIONS
    if hasattr(registry, "get_interface"):  # transformers >= 5.2x
        return registry.get_interface(impl, family.eager_attention_forward)
    return family.eager_attention_forward if impl == "eager" else registry[impl]


def unit_stride_angles(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [B, S, R] with unit stride on R, as the fused kernels take them.

    Transformers 5.17's GPT-OSS rotary embedding hands them as transposed views (stride S on the last dim): without
    this copy (two small tensors, once per layer) every layer took the eager RoPE (the H200 profile of 2026-12-04:
    ~8 ms a step of strided muls, cats and copies in gpt-oss-20b L8).
    """
    if cos.dim() == 3 and cos.stride(-1) != 1:
        return cos.contiguous(), sin.contiguous()
    return cos, sin


def wants_engine_attention(rope: str) -> bool:
    """Whether a resolved BackendConfig.rope asks for the engine's attention classes ('triton'; 'torch': no)."""
    if rope not in ("torch", "triton"):
        raise ValueError(f"rope must be a resolved BackendConfig.rope, 'torch' or 'triton'; got {rope!r}")
    return rope == "triton"


def fused_rope_forward(
    module: nn.Module,
    family: ModuleType,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    kwargs: dict,
    q_norm: nn.Module | None = None,
    k_norm: nn.Module | None = None,
    residual: torch.Tensor | None = None,
    **attention_extras,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A Llama-style attention forward of `family` (q/k/v projections, per-head q/k norms where given, RoPE, the
    family's attention function with `attention_extras`, o_proj) with RoPE on the fused kernel where it applies;
    with `residual`, o_proj's output comes back with it added (o_proj_residual)."""
    from workbench.kernels.triton_rope import apply_rope, supported  # Triton: optional, imported where its kernel runs

    kwargs.pop("cache", None)
    kwargs.pop("past_key_values", None)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    q, k, v = qkv_projection(hidden_states, module.q_proj, module.k_proj, module.v_proj)
    q, k = q.view(hidden_shape), k.view(hidden_shape)
    v_BHSD = v.view(hidden_shape).transpose(1, 2)
    cos, sin = unit_stride_angles(*position_embeddings)
    q_BHSD, k_BHSD = q.transpose(1, 2), k.transpose(1, 2)
    if fused_norm_rope_applies(q_norm, q_BHSD, cos) and fused_norm_rope_applies(k_norm, k_BHSD, cos):
        # the per-head norms and RoPE in one kernel each way (kernels/triton_norm_rope.py)
        from workbench.kernels.triton_norm_rope import norm_rope  # Triton: optional, imported where its kernel runs

        q_BHSD = norm_rope(q_BHSD, q_norm.weight, q_norm.variance_epsilon, cos, sin)
        k_BHSD = norm_rope(k_BHSD, k_norm.weight, k_norm.variance_epsilon, cos, sin)
    else:
        q_BHSD = (q_norm(q) if q_norm is not None else q).transpose(1, 2)
        k_BHSD = (k_norm(k) if k_norm is not None else k).transpose(1, 2)
        if supported(q_BHSD, cos) and supported(k_BHSD, cos):
            q_BHSD, k_BHSD = apply_rope(q_BHSD, k_BHSD, cos, sin)
        else:
            # said, not silent: a layout the kernel refuses once kept GPT-OSS's fused RoPE off on one
            # Transformers version while every parity test passed (Python shows each distinct message once)
            warnings.warn(
                f"rope='triton': the fused RoPE kernel does not take q {tuple(q_BHSD.shape)} / cos "
                f"{tuple(cos.shape)} (strides {cos.stride()}); {type(module).__name__} applies Transformers' RoPE "
                "instead",
                stacklevel=2,
            )
            q_BHSD, k_BHSD = family.apply_rotary_pos_emb(q_BHSD, k_BHSD, cos, sin)
    out, weights = attention_function(family, module.config._attn_implementation)(
        module,
        q_BHSD,
        k_BHSD,
        v_BHSD,
        attention_mask,
        dropout=0.0 if not module.training else module.attention_dropout,
        scaling=module.scaling,
        sliding_window=getattr(module, "sliding_window", None),
        **attention_extras,
        **kwargs,
    )
    out = out.reshape(*input_shape, -1).contiguous()
    return o_proj_residual(module.o_proj, out, residual), weights


def o_proj_residual(o_proj: nn.Module, out: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """o_proj(out), plus `residual` when given: added by the GEMM (addmm, beta 1) where o_proj is a plain linear.

    The sum is float32 in cuBLAS and rounded once, where Transformers rounds the projection and then the add; the
    residual's gradient is the output's own (addmm's backward hands it on without a copy).
    """
    if residual is None:
        return o_proj(out)
    plain = type(o_proj) is nn.Linear and o_proj.bias is None and residual.dtype == out.dtype == o_proj.weight.dtype
    if not plain or torch.is_autocast_enabled(out.device.type):
        return residual + o_proj(out)
    out_ND = out.reshape(-1, out.shape[-1])
    return torch.addmm(residual.reshape(-1, residual.shape[-1]), out_ND, o_proj.weight.t()).view(residual.shape)


def fused_norm_rope_applies(norm: nn.Module | None, x_BHSD: torch.Tensor, cos: torch.Tensor) -> bool:
    """Whether a per-head norm and RoPE run as one kernel: the engine's Triton RMSNorm over a layout it takes.

    Not a zero-centered norm (offset, scale 1 + weight): the norm + RoPE kernel scales by the weight itself."""
    if not isinstance(norm, RMSNorm) or norm.backend != "triton" or norm.offset:
        return False
    # Triton: optional, imported where its kernel runs
    from workbench.kernels.triton_norm_rope import supported as norm_rope_supported

    return norm_rope_supported(x_BHSD, norm.weight, cos)
