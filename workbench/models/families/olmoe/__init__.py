"""OLMoE: the generic path as it is; the family adds its presets, its q/k norms' parameters and its tests' config."""

from __future__ import annotations

from workbench.models.families.family import AttentionWidths, Family
from workbench.models.families.olmoe.presets import PRESETS


def attention_params(widths: AttentionWidths) -> int:
    """Its q_norm and k_norm over all heads (not per head, as Qwen3's)."""
    return (widths.heads + widths.kv_heads) * widths.head_dim


FAMILY = Family(
    model_type="olmoe",
    name="OLMoE",
    presets=PRESETS,
    test_config=dict(intermediate_size=32, num_experts=4, num_experts_per_tok=2),
    attention_params=attention_params,
    qk_norm=True,
)
