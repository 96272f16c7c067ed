"""Tiny Qwen3-MoE configs shared by the tests (built from configs, random init, no hub)."""

from __future__ import annotations

from transformers import Qwen3MoeConfig


def tiny_qwen3_moe(**overrides) -> Qwen3MoeConfig:
    """A small Qwen3-MoE config; keyword overrides replace fields."""
    fields = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Qwen3MoeConfig(**fields)


# Shapes the parity tests sweep: default, unnormalized top-k, dense layers mixed in, odd widths.
PARITY_SHAPES = {
    "base": {},
    "no_norm_topk": dict(norm_topk_prob=False, num_experts_per_tok=3),
    "mlp_only_layers": dict(num_hidden_layers=3, mlp_only_layers=[1]),
    "odd_widths": dict(
        hidden_size=36,
        moe_intermediate_size=13,
        intermediate_size=27,
        num_attention_heads=3,
        num_key_value_heads=1,
        head_dim=12,
        num_experts=5,
        vocab_size=101,
    ),
}


def trained(rc, steps: int):
    """A Trainer set up from RunConfig `rc` after `steps` train steps, and those steps' records."""
    from workbench.train.loop import Trainer

    trainer = Trainer(rc)
    trainer.setup()
    for step in range(1, steps + 1):
        trainer.train_step(step)
    return trainer, trainer.collect(wait=True)
