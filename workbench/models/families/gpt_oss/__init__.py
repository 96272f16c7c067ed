"""GPT-OSS: the generic path plus the engine's fused-RoPE attention and experts kernel (sinks, biases, its presets).

- attention.py: RoPE on one fused kernel (rope='triton') with GPT-OSS's half-width cos/sin.
- experts.py: the experts' biases and clamped interleaved SwiGLU in one Triton kernel (swiglu='triton').
Its sink attention is the engine's (models/attention_sinks.py), which attention='auto' picks for this family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from workbench.models.families.family import AttentionWidths, Family
from workbench.models.families.gpt_oss.presets import PRESETS


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine attention where the resolved `backend` asks for it; how many modules."""
    # Transformers' GPT-OSS modeling module comes with it: imported when a model is built, not with the presets
    from workbench.models.families.gpt_oss.attention import use_gpt_oss_attention

    return {"rope": use_gpt_oss_attention(model, backend.rope)}


def expert_rows(module, swiglu: str) -> Callable | None:
    """GPT-OSS's fused bias + gate rows where swiglu='triton' and `module` computes GPT-OSS's gate, else None."""
    if swiglu != "triton":
        return None
    from workbench.models.families.gpt_oss.experts import gpt_oss_expert_rows, is_gpt_oss_gate

    return gpt_oss_expert_rows if is_gpt_oss_gate(module) else None


def attention_params(widths: AttentionWidths) -> int:
    """Its attention sinks, one per head."""
    return widths.heads


TEST_CONFIG: dict[str, Any] = dict(
    intermediate_size=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"],
)

FAMILY = Family(
    model_type="gpt_oss",
    name="GPT-OSS",
    presets=PRESETS,
    test_config=TEST_CONFIG,
    install_extras=install_extras,
    expert_rows=expert_rows,
    sinks_by_default=True,
    attention_params=attention_params,
    biased_experts=True,
)
