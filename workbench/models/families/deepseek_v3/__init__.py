"""DeepSeek-V3 (and Moonlight): the generic path plus the engine's latent attention and router (its presets).

- attention.py: MLA's query, key and value built with RoPE in one fused kernel (rope='triton').
- router.py: the sigmoid router's float32 logits from bf16 tensor-core GEMMs.
MLA's parameter counts are read from the config's fields (workbench/params.is_mla), for any family with them.
"""

from __future__ import annotations

from typing import Any

from workbench.models.families.deepseek_v3.presets import PRESETS
from workbench.models.families.family import Family


def install_extras(model, backend) -> dict[str, int]:
    """The family's engine attention and router where the resolved `backend` asks for them; how many of each."""
    # Transformers' DeepSeek-V3 modeling module comes with these: imported when a model is built, not with the presets
    from workbench.models.families.deepseek_v3.attention import use_mla_attention
    from workbench.models.families.deepseek_v3.router import use_deepseek_router

    return {"rope": use_mla_attention(model, backend.rope), "float32_router": use_deepseek_router(model)}


TEST_CONFIG: dict[str, Any] = dict(
    intermediate_size=32,
    moe_intermediate_size=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=8,
    num_key_value_heads=4,
)

FAMILY = Family(
    model_type="deepseek_v3",
    name="DeepSeek-V3",
    presets=PRESETS,
    test_config=TEST_CONFIG,
    install_extras=install_extras,
)
