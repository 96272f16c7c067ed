"""Parameter counts of a Transformers MoE config, without building the model (pure functions).

One counter for the Studio (model picker, memory estimate), the bench's step floor and the FLOPs
formula. It reads the families' own field names: Qwen3-MoE / Qwen2-MoE / OLMoE (`num_experts`),
Mixtral / GPT-OSS (`num_local_experts`), DeepSeek-V3 (`n_routed_experts`, `n_shared_experts`,
`first_k_dense_replace`, MLA ranks and head dims), and counts what those modules hold: attention
biases, router and expert biases, MLA's latent norms, and what a family's attention adds (its folder's
`attention_params`: GPT-OSS's sinks, OLMoE's and Qwen3's q/k norms; models/families/).
Buffers (DeepSeek-V3's score-correction bias) are not parameters and are not counted.
A hybrid's layers differ (its family's `layer_blocks`): Nemotron-H's hold one block each (Mamba2, attention, MoE
or a relu² MLP), Qwen3.5-MoE's and Qwen3-Next's a Gated DeltaNet or attention before their MoE; the sequence
mixers are counted by workbench/mixer_counts.py.

Active parameters are those one token uses: everything but the routed experts, plus top-k of
them in each MoE layer (shared experts always run). Vendors differ in how they quote it: Qwen,
Mixtral, OLMoE and Moonlight count the embedding table, OpenAI's "3.6B active" for gpt-oss-20b
leaves it out (`active - embed`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.mixer_counts import mixer_counts
from workbench.models.families import AttentionWidths, LayerBlocks, family_for

EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _get(cfg: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(cfg, name, None)
        if value is not None:
            return value
    return default


def num_experts(cfg: Any) -> int:
    """Routed experts per MoE layer, whatever the family calls the field (0 for a dense model)."""
    return int(_get(cfg, *EXPERT_COUNT_FIELDS, default=0))


def is_mla(cfg: Any) -> bool:
    """Whether the config describes DeepSeek's multi-head latent attention."""
    return getattr(cfg, "kv_lora_rank", None) is not None and getattr(cfg, "qk_rope_head_dim", None) is not None


def head_dims(cfg: Any) -> tuple[int, int]:
    """(query/key width, value width) of one attention head."""
    if is_mla(cfg):
        return cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim
    d = _get(cfg, "head_dim", default=cfg.hidden_size // cfg.num_attention_heads)
    return d, d


def _sparse_layer_flags(cfg: Any) -> list[bool]:
    """Which decoder layers hold routed experts by the generic rule.

    Qwen-style configs mark dense layers with mlp_only_layers / decoder_sparse_step, DeepSeek-V3
    keeps its first `first_k_dense_replace` layers dense; everything else with experts is MoE.
    """
    layers = cfg.num_hidden_layers
    if num_experts(cfg) == 0:
        return [False] * layers
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    first_dense = getattr(cfg, "first_k_dense_replace", 0) or 0
    return [i not in mlp_only and (i + 1) % step == 0 and i >= first_dense for i in range(layers)]


def layer_blocks(cfg: Any) -> tuple[LayerBlocks, ...]:
    """Each decoder layer's blocks: a hybrid family's own (Family.layer_blocks), else attention and an MoE (where the
    generic rule puts experts) or a dense MLP."""
    sparse = _sparse_layer_flags(cfg)
    own = family_for(getattr(cfg, "model_type", "")).layer_blocks
    if own is not None:
        return tuple(own(cfg, sparse))
    return tuple(LayerBlocks("attention", "moe" if s else "dense") for s in sparse)


def moe_layer_flags(cfg: Any) -> list[bool]:
    """Which decoder layers hold routed experts (layer_blocks)."""
    return [blocks.mlp == "moe" for blocks in layer_blocks(cfg)]


def attention_layer_flags(cfg: Any) -> list[bool]:
    """Which decoder layers hold attention (every layer but a hybrid's others: layer_blocks)."""
    return [blocks.mixer == "attention" for blocks in layer_blocks(cfg)]


def sliding_layer_flags(cfg: Any) -> list[bool]:
    """Which layers use sliding-window attention (GPT-OSS's alternating layer_types)."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None) or []
    return [bool(window) and i < len(types) and types[i] == "sliding_attention" for i in range(cfg.num_hidden_layers)]


def _attention(cfg: Any) -> tuple[int, int]:
    """(all parameters, projection weights) of one attention block."""
    hidden, heads = cfg.hidden_size, cfg.num_attention_heads
    bias = bool(getattr(cfg, "attention_bias", False))
    if is_mla(cfg):
        qk, v = head_dims(cfg)
        q_rank, kv_rank, rope = getattr(cfg, "q_lora_rank", None), cfg.kv_lora_rank, cfg.qk_rope_head_dim
        if q_rank:
            q_weights = hidden * q_rank + q_rank * heads * qk
            q_other = q_rank + q_rank * bias  # q_a_layernorm; q_a_proj's bias
        else:
            q_weights, q_other = hidden * heads * qk, 0
        weights = (
            q_weights
            + hidden * (kv_rank + rope)  # kv_a_proj_with_mqa: latent + shared rope key
            + kv_rank * heads * (qk - rope + v)  # kv_b_proj: per-head nope keys and values
            + heads * v * hidden
        )  # o_proj
        other = q_other + kv_rank + bias * (kv_rank + rope + hidden)  # kv_a_layernorm; biases
        return weights + other, weights
    kv_heads = _get(cfg, "num_key_value_heads", default=heads)
    d, _ = head_dims(cfg)
    q, kv = heads * d, kv_heads * d
    q_out = q * (2 if family_for(getattr(cfg, "model_type", "")).gated_query else 1)  # Qwen3.5's output gate
    weights = hidden * (q_out + 2 * kv) + q * hidden
    other = bias * (q_out + 2 * kv + hidden)
    # what the family's attention holds beyond these (Qwen3's and OLMoE's q/k norms, GPT-OSS's sinks)
    other += family_for(getattr(cfg, "model_type", "")).attention_params(AttentionWidths(heads, kv_heads, d))
    return weights + other, weights


def _mlp_width(cfg: Any) -> int:
    """Width of one routed expert (moe_intermediate_size; Mixtral and GPT-OSS use intermediate_size)."""
    width = _get(cfg, "moe_intermediate_size", default=None)  # Qwen3.5-MoE's config has no intermediate_size at all
    return width if width is not None else cfg.intermediate_size


def experts_input_width(cfg: Any) -> int:
    """The width routed experts take and give back: hidden_size, or the latent width a LatentMoE projects each token
    into around them (Nemotron 3 Super's and Ultra's moe_latent_size: fc1_latent_proj before, fc2_latent_proj after)."""
    return int(getattr(cfg, "moe_latent_size", None) or cfg.hidden_size)


def _latent_projections(cfg: Any, hidden: int) -> int:
    """A LatentMoE layer's two projections, hidden -> latent -> hidden (with biases where mlp_bias); 0 without."""
    latent = getattr(cfg, "moe_latent_size", None)
    if not latent:
        return 0
    return 2 * hidden * latent + bool(getattr(cfg, "mlp_bias", False)) * (latent + hidden)


def _shared_width(cfg: Any, width: int) -> int:
    """Intermediate width of one MoE layer's shared experts together (0: none)."""
    own = _get(
        cfg,
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "shared_intermediate_size",
        default=None,
    )
    # Qwen2-MoE, Qwen3.5-MoE, Qwen3-Next; Nemotron-H, GraniteMoE-Hybrid: one shared expert of its own width
    if own:
        return int(own)
    return width * int(getattr(cfg, "n_shared_experts", 0) or 0)  # DeepSeek-V3: n experts of the routed width


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of a model, split the way the mesh shards them and the FLOPs formula needs them."""

    embed: int
    lm_head: int  # 0 when tied to the embedding
    norms: int  # the decoder layers' and the final RMSNorm weights
    attention_per_layer: int  # everything in one attention block
    attention_matmul_per_layer: int  # its projection weight matrices
    router_per_layer: int  # the router (and a shared expert's sigmoid gate)
    expert_params: int  # one routed expert, biases included
    expert_matmul: int  # one routed expert's weight matrices
    shared_per_layer: int  # shared experts of one MoE layer (dense: every token runs them)
    dense_mlp_per_layer: int  # the MLP of a layer without experts
    layers: int
    moe_layers: int
    num_experts: int
    top_k: int
    hidden: int
    vocab: int
    attention_layers: int  # layers with attention (every layer but a hybrid's mixer-only ones)
    dense_mlp_layers: int  # layers with a dense MLP
    mixer_layers: int = 0  # a hybrid's layers with another sequence mixer (Mamba2, Gated DeltaNet)
    mixer_per_layer: int = 0  # everything in one of those mixers (workbench/mixer_counts.py)
    mixer_matmul_per_layer: int = 0  # its projection weight matrices
    # a LatentMoE layer's projections into the experts' latent width and back (every token runs them)
    latent_per_layer: int = 0

    @property
    def experts_per_layer(self) -> int:
        """All E routed experts of one MoE layer."""
        return self.num_experts * self.expert_params

    @property
    def experts(self) -> int:
        """All routed-expert parameters of the model (sharded over ep x edp)."""
        return self.experts_per_layer * self.moe_layers

    @property
    def dense(self) -> int:
        """Everything that is not a routed expert (sharded over dp)."""
        return (
            self.embed
            + self.lm_head
            + self.norms
            + self.attention_layers * self.attention_per_layer
            + self.mixer_layers * self.mixer_per_layer
            + self.moe_layers * (self.router_per_layer + self.shared_per_layer + self.latent_per_layer)
            + self.dense_mlp_layers * self.dense_mlp_per_layer
        )

    @property
    def total(self) -> int:
        return self.dense + self.experts

    @property
    def active(self) -> int:
        """Parameters one token uses: the dense part and top-k routed experts per MoE layer."""
        return self.dense + self.moe_layers * self.top_k * self.expert_params

    @property
    def active_matmul(self) -> int:
        """Weights of the matmuls one token goes through (the FLOPs formula's parameters).

        Attention and mixer projections, the dense and shared MLPs, top-k experts and the LM head (a matmul
        even when tied); not the embedding lookup, norms, biases or the router (as NeMo counts).
        """
        return (
            self.vocab * self.hidden
            + self.attention_layers * self.attention_matmul_per_layer
            + self.mixer_layers * self.mixer_matmul_per_layer
            + self.dense_mlp_layers * self.dense_mlp_per_layer
            + self.moe_layers * (self.shared_per_layer + self.latent_per_layer + self.top_k * self.expert_matmul)
        )


def param_counts(cfg: Any) -> ParamCounts:
    """Count the parameters of a transformers MoE (or dense) decoder config."""
    hidden, vocab, layers = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    family = family_for(getattr(cfg, "model_type", ""))
    experts = num_experts(cfg)
    width = _mlp_width(cfg)
    blocks = layer_blocks(cfg)
    mixers = {b.mixer for b in blocks} - {"attention", None}
    if len(mixers) > 1:
        raise ValueError(f"model_type {cfg.model_type!r}: layers with different sequence mixers {sorted(mixers)}")
    mixer = mixer_counts(cfg, mixers.pop()) if mixers else None
    attention, attention_matmul = _attention(cfg) if any(b.mixer == "attention" for b in blocks) else (0, 0)
    matrices = 3 if family.gated_mlps else 2  # gate, up, down; Nemotron-H's relu² MLPs: up, down
    experts_in = experts_input_width(cfg)
    expert_matmul = matrices * experts_in * width
    # GPT-OSS: biases on the router and on both expert projections.
    has_bias = family.biased_experts
    expert_params = expert_matmul + has_bias * (2 * width + experts_in)
    shared = matrices * hidden * _shared_width(cfg, width)
    top_k = int(_get(cfg, "num_experts_per_tok", default=1)) if experts else 0
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    return ParamCounts(
        embed=vocab * hidden,
        lm_head=0 if tied else vocab * hidden,
        # each block's pre-norm and the final norm
        norms=(sum((b.mixer is not None) + (b.mlp is not None) for b in blocks) + 1) * hidden,
        attention_per_layer=attention,
        attention_matmul_per_layer=attention_matmul,
        router_per_layer=experts * hidden + has_bias * experts + family.shared_expert_gate * hidden,
        expert_params=expert_params,
        expert_matmul=expert_matmul,
        shared_per_layer=shared,
        # Qwen3.5-MoE has no intermediate_size at all
        dense_mlp_per_layer=matrices * hidden * (getattr(cfg, "intermediate_size", None) or 0),
        layers=layers,
        moe_layers=sum(b.mlp == "moe" for b in blocks),
        num_experts=experts,
        top_k=top_k,
        hidden=hidden,
        vocab=vocab,
        attention_layers=sum(b.mixer == "attention" for b in blocks),
        dense_mlp_layers=sum(b.mlp == "dense" for b in blocks),
        mixer_layers=sum(b.mixer not in ("attention", None) for b in blocks),
        mixer_per_layer=mixer.params if mixer else 0,
        mixer_matmul_per_layer=mixer.matmul if mixer else 0,
        latent_per_layer=_latent_projections(cfg, hidden),
    )
