"""Memory per rank, estimated from parameter counts (no model is built).

The estimate (bytes on one rank, b = bytes per element of the training dtype):

    sharded state   = (dense / dp + experts / (ep * edp)) * 4b
                      # param + grad + AdamW exp_avg + exp_avg_sq, all in the model dtype
                      # (torch AdamW keeps its states in the parameter dtype; no fp32 master copy)
    gathered (dp>1) = b * (2 * (embed + lm_head)            # root module stays unsharded (+ its grad)
                           + 3 * one decoder layer)          # all-gathered layer, prefetch, grad
                      # one decoder layer = attention + router + this rank's E/ep experts
    activations     = tokens * layers * b * per_token_layer  # tokens = local_batch * seq
                      per_token_layer = 4H + 2*n_h*d + 2*n_kv*d + 2H + k * (2H + 3*I_e)
                      # norms/residual, q, k/v, attention out, router input; each of the k
                      # routed copies keeps its input, output and gate/up/activation
                      with activation checkpointing: tokens * b * (layers * H + per_token_layer)
    logits          = tokens * V * (b + 8)                   # logits, fp32 upcast and fp32 grad
                      (0 with the fused linear cross-entropy)

Against facts.md's measured Transformers anchors (Qwen3-30B-A3B, bf16, seq 4096, batch 2) it
lands within 5%: 1 GPU 8 layers 62.2 vs 59.6 GiB, 2 GPUs FSDP2 8 layers 47.2 vs 46.3 GiB,
16 layers 74.7 vs 72.1 GiB (tests/test_ui.py checks these).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

GIB = float(1 << 30)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a Qwen3-MoE-style model, split the way the mesh shards them."""

    embed: int
    lm_head: int
    attention_per_layer: int
    norms: int  # all RMSNorm weights (per-layer and final)
    router_per_layer: int
    experts_per_layer: int  # all E experts of one MoE layer
    dense_mlp_per_layer: int  # a non-MoE layer's MLP (mlp_only_layers), 0 if none
    layers: int
    moe_layers: int
    num_experts: int
    top_k: int

    @property
    def experts(self) -> int:
        """All routed-expert parameters of the model."""
        return self.experts_per_layer * self.moe_layers

    @property
    def dense(self) -> int:
        """Everything that is not a routed expert (sharded over dp)."""
        return (self.embed + self.lm_head + self.norms + self.layers * self.attention_per_layer
                + self.moe_layers * self.router_per_layer
                + (self.layers - self.moe_layers) * self.dense_mlp_per_layer)

    @property
    def total(self) -> int:
        return self.dense + self.experts

    @property
    def active(self) -> int:
        """Parameters one token touches (k of E experts)."""
        return self.dense + self.experts * self.top_k // max(1, self.num_experts)


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def param_counts(cfg: Any) -> ParamCounts:
    """Count parameters from a transformers MoE config (Qwen3-MoE layout)."""
    hidden, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    heads = cfg.num_attention_heads
    kv_heads = _get(cfg, "num_key_value_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=hidden // heads)
    experts = int(_get(cfg, "num_experts", "num_local_experts", "n_routed_experts", default=0))
    moe_width = _get(cfg, "moe_intermediate_size", default=cfg.intermediate_size)
    top_k = int(_get(cfg, "num_experts_per_tok", default=1))
    attention = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2
    if getattr(cfg, "model_type", "") == "qwen3_moe":
        attention += 2 * head_dim  # q_norm, k_norm
    if getattr(cfg, "attention_bias", False):
        attention += heads * head_dim + 2 * kv_heads * head_dim
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    moe_layers = sum(1 for i in range(layers) if i not in mlp_only and experts > 0 and (i + 1) % step == 0)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    return ParamCounts(
        embed=vocab * hidden, lm_head=0 if tied else vocab * hidden, attention_per_layer=attention,
        norms=(2 * layers + 1) * hidden, router_per_layer=experts * hidden,
        experts_per_layer=experts * 3 * hidden * moe_width,
        dense_mlp_per_layer=3 * hidden * cfg.intermediate_size, layers=layers, moe_layers=moe_layers,
        num_experts=experts, top_k=top_k)


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated bytes on one rank, by part (see the module docstring for the formula)."""

    sharded_state: float
    gathered: float
    activations: float
    logits: float

    @property
    def total(self) -> float:
        return self.sharded_state + self.gathered + self.activations + self.logits

    @property
    def total_gib(self) -> float:
        return self.total / GIB

    def as_gib(self) -> dict[str, float]:
        """Each part and the total in GiB (for tables)."""
        out = {k: v / GIB for k, v in asdict(self).items()}
        out["total"] = self.total_gib
        return out


def resolve_dtype(dtype: str, device_type: str) -> str:
    """What dtype="auto" trains in on `device_type` (bfloat16 on CUDA, float32 on CPU)."""
    if dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {['auto', *DTYPE_BYTES]}")
    return dtype


def estimate_memory(cfg: Any, dp: int, ep: int, *, seq_len: int, local_batch: int, dtype: str = "auto",
                    device_type: str = "cuda", activation_checkpointing: bool = False, fused_ce: bool = False) -> MemoryEstimate:
    """Estimated memory of one rank training `cfg` on a dp x ep mesh (documented above)."""
    if dp < 1 or ep < 1 or dp % ep:
        raise ValueError(f"need dp >= 1 and ep dividing dp, got dp={dp}, ep={ep}")
    counts = param_counts(cfg)
    if counts.num_experts and counts.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the model's {counts.num_experts} experts")
    b = DTYPE_BYTES[resolve_dtype(dtype, device_type)]
    edp = dp // ep
    sharded = (counts.dense / dp + counts.experts / (ep * edp)) * 4 * b
    gathered = 0.0
    if dp > 1:
        layer = counts.attention_per_layer + counts.router_per_layer + counts.experts_per_layer / ep
        gathered = b * (2 * (counts.embed + counts.lm_head) + 3 * layer)
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    kv_heads = _get(cfg, "num_key_value_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=hidden // heads)
    moe_width = _get(cfg, "moe_intermediate_size", default=cfg.intermediate_size)
    per_token_layer = (6 * hidden + 2 * heads * head_dim + 2 * kv_heads * head_dim
                       + counts.top_k * (2 * hidden + 3 * moe_width))
    tokens = seq_len * local_batch
    if activation_checkpointing:
        activations = tokens * b * (counts.layers * hidden + per_token_layer)
    else:
        activations = tokens * b * counts.layers * per_token_layer
    logits = 0.0 if fused_ce else tokens * cfg.vocab_size * (b + 8)
    return MemoryEstimate(sharded_state=sharded, gathered=gathered, activations=activations, logits=logits)
