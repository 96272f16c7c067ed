"""Hugging Face integration: every MoE family runs on the generic engine path (workbench.models.generic).

Qwen3-MoE is that path plus its own extras (fused-RoPE attention, float32 router logits:
models/generic_extras.py), not a second engine.
"""
