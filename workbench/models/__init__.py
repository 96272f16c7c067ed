"""Hugging Face integration: every MoE family runs on the generic engine path (workbench.models.generic).

A family that adds something to that path (Qwen3-MoE's fused-RoPE attention, fused residual adds and float32
router logits, GPT-OSS's, DeepSeek-V3's) holds it in its own folder, models/families/<model_type>/, registered in
models/families/__init__.py: extras on the one path, not a second engine.
"""
