"""Qwen3-MoE's decoder layer with the residual stream's adds folded into the kernels around them (training path).

Transformers' layer adds the attention output and the MoE output to the residual stream in two elementwise kernels
in the forward, and autograd adds the stream's gradient to each norm's input gradient in two more in the backward
(four passes over the [tokens, hidden] activations a layer). Here the attention's output projection adds the
residual in its GEMM (addmm, beta 1: models/engine_attention.o_proj_residual), the MoE combine adds it in its
weighted sum (handed to the experts as an argument where their dispatcher's combine adds a residual: the local one;
others take the plain add), and each RMSNorm returns its input as the residual stream too, summing the two gradients
in its backward kernel (kernels/rms_norm.rms_norm_residual). The layer keeps Transformers' parameters and
submodules; with a KV cache or Transformers' attention it runs Transformers' forward.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

from workbench.models.class_swap import swap_classes
from workbench.models.engine_attention import engine_forward_applies
from workbench.models.families.qwen3_moe.attention import Qwen3MoeEngineAttention
from workbench.models.families.qwen3_moe.router import Qwen3MoeEngineRouter
from workbench.moe.hf_experts import EngineExperts

# Shape suffixes: B batch, S sequence, D hidden, T tokens, K top-k.


def norm_residual(norm: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(x), x): the engine's RMSNorm fuses the residual's gradient into its backward; any other norm does not."""
    forward_residual = getattr(norm, "forward_residual", None)
    return forward_residual(x) if forward_residual is not None else (norm(x), x)


class Qwen3MoeEngineDecoderLayer(hf.Qwen3MoeDecoderLayer):
    """Transformers' Qwen3MoeDecoderLayer whose training forward folds the residual adds into its kernels."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs):
        """Transformers' forward; with the engine's attention applying (no cache), the residual adds are fused."""
        if not (
            isinstance(self.self_attn, Qwen3MoeEngineAttention) and engine_forward_applies(self.self_attn, args, kwargs)
        ):
            return super().forward(hidden_states, *args, **kwargs)
        normed, residual = norm_residual(self.input_layernorm, hidden_states)
        hidden_states, _ = self.self_attn(hidden_states=normed, residual=residual, **kwargs)
        normed, residual = norm_residual(self.post_attention_layernorm, hidden_states)
        experts = moe_experts_adding_residual(self.mlp)
        if experts is not None:  # the router hands its input on, the experts' combine adds the residual in its sum
            return moe_adding_residual(self.mlp, experts, normed, residual)
        out = self.mlp(normed)
        if isinstance(out, tuple):  # Transformers versions whose MoE block also returns its router logits
            out = out[0]
        return residual + out


def moe_adding_residual(
    mlp: nn.Module, experts: EngineExperts, x_BSD: torch.Tensor, residual_BSD: torch.Tensor
) -> torch.Tensor:
    """residual + Qwen3's MoE block on x, the block's own steps (router, then experts) with the add in the combine.

    One token's walk through the layer: the router (Qwen3MoeEngineRouter.forward: float32 logits, softmax + top-k),
    then the experts (EngineExperts.forward: dispatch, the experts' grouped GEMMs, combine plus `residual_BSD`).
    The engine's router hands x on to the experts (its pass_input), so its backward sums the experts' input
    gradient into its own GEMM: x's gradient without an add of its own.
    """
    _, weights_TK, ids_TK, x_TD = mlp.gate(x_BSD.reshape(-1, x_BSD.shape[-1]), pass_input=True)
    return experts(x_TD, ids_TK, weights_TK, residual=residual_BSD).view_as(x_BSD)


def moe_experts_adding_residual(mlp: nn.Module) -> EngineExperts | None:
    """The engine experts of a Qwen3 MoE block whose steps the layer runs itself, adding the residual, or None.

    The block's output is its experts' combine reshaped (no shared expert), so a residual the combine adds is the
    layer's residual add: where the router is the engine's (it hands its input on), the experts' dispatcher adds
    a residual in its combine (the local one: its caps), and no hook on the block expects the block's own call
    (None then: the block's forward runs and the layer adds the residual itself).
    """
    experts = getattr(mlp, "experts", None)
    if type(mlp) is not hf.Qwen3MoeSparseMoeBlock or not isinstance(experts, EngineExperts):
        return None
    if not isinstance(mlp.gate, Qwen3MoeEngineRouter) or mlp._forward_hooks or mlp._forward_pre_hooks:
        return None
    return experts if experts.plan.combine_adds_residual else None


def use_engine_decoder_layers(model: nn.Module, rope: str) -> int:
    """rope='triton' (the engine's attention): every Qwen3MoeDecoderLayer of `model` fuses its residual adds."""
    if rope != "triton":
        return 0
    return swap_classes(model, hf.Qwen3MoeDecoderLayer, Qwen3MoeEngineDecoderLayer)
