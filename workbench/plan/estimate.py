"""Memory per rank, estimated from parameter counts (no model is built).

The estimate (bytes on one rank, b = bytes per element of the training dtype):

    sharded state   = (dense / dp + experts / (ep * edp)) * 4b
                      # param + grad + AdamW exp_avg + exp_avg_sq, all in the model dtype
                      # (torch AdamW keeps its states in the parameter dtype; no fp32 master copy)
                      # optimizer_states "8bit": the two moments take 2 + 8/64 bytes instead of 2b
                      # (one byte each and a float32 scale per block of at most 64..256 elements)
    gathered (dp>1) = b * (2 * (embed + lm_head)            # root module stays unsharded (+ its grad)
                           + 3 * one decoder layer)          # all-gathered layer, prefetch, grad
                      # one decoder layer = attention (or a hybrid's mixer) + router + shared experts
                      # + this rank's E/ep experts (or its dense MLP); the largest layer counts
    activations     = tokens * b * sum over layers of per_token_layer   # tokens = local_batch * seq
                      per_token_layer = 2H per block (its input, the residual; its norm's output, the input of
                                        every projection, router and expert after it) + mixer + mlp
                                        (a transformer layer has two blocks, a Nemotron-H layer one)
                      attention = 2*n_h*d + 2*n_kv*d         # q, k, v after RoPE, attention out
                                  + (n_h + n_kv)*d           # q/k norms' inputs (Family.qk_norm)
                                  + 3*n_h*d                  # a gated query's gate, sigmoid, gated out
                                  MLA: n_h*(2*d_qk + 2*d_v) + 2*kv_lora + rope + 2*q_lora
                                       (the low-rank projections' outputs and their norms' outputs)
                      Mamba2, Gated DeltaNet: their projections', conv's, output's and gated norm's
                                  widths and their chunk states' share (workbench/mixer_counts.py)
                      mlp (MoE)   = E + k * (R + g*I_e)      # router probabilities; each of the k routed
                                    (+ k*R)                  # copies keeps its input row and gate/up and
                                    + g*I_s (+ H)            # activation; its output only where the combine
                                                             # weighs the rows; shared experts (+ the output
                                                             # a sigmoid shared-expert gate multiplies)
                      mlp (dense) = g*I                      # a dense layer's MLP
                      R = H (a LatentMoE's moe_latent_size L; the combined latent rows add L, fc2_latent_proj's
                          input). The combine keeps no expert outputs where the rows take their routing weights
                          (moe/row_weights.py: a plain SwiGLU, bias-free experts, the one-rank dispatcher, ep 1)
                      g = 3 (gate, up, activation); 2 for Nemotron-H's relu² MLPs (up, activation)
                      These are the engine's kernels as CUDA runs them (Triton's RMSNorm, norm + RoPE, packed
                      weighted SwiGLU); tests/test_plan_activations.py counts the bytes autograd saves at
                      Qwen3-30B-A3B's width ratios: within 4% for LoRA and full fine-tuning (the old count, with a
                      2H router input and every copy's output, was 23-24% over; a 1 x H100 LoRA run measured
                      0.406 GiB a layer beside a checkpointed one at 4096 tokens). torch's CPU kernels keep more
                      (the norms' normalized inputs, SwiGLU's silu and product): about 1.35x in float32 there.
                      with activation checkpointing: tokens * b * (layers * H + max per_token_layer)
    logits          = tokens * V * (b + 8)                   # logits, fp32 upcast and fp32 grad
                      (0 with the fused linear cross-entropy)

With LoRA (`lora=`, a workbench LoraConfig) the base is frozen: it keeps only its weights
(dense / dp + experts / (ep * edp)) * b, the adapters (A, B per target, counted on the meta model:
models/lora_targets.adapter_counts) keep param + grad + AdamW's two moments, / dp like the base;
a gathered layer needs no gradient buffer (2 layers, not 3; the root's embeddings once), and each
adapter a token passes keeps its r-wide x @ A in the activations.

Parameters are counted per family (workbench.params): GPT-OSS's biases, DeepSeek-V3's shared
experts and dense first layers. Against Transformers' peaks measured on the H200 (Qwen3-30B-A3B,
bf16, seq 4096, batch 2) this sum of everything at once lands within 5%: 1 GPU 8 layers 60.3 vs 59.6 GiB,
2 GPUs FSDP2 8 layers 45.2 vs 46.3 GiB, 16 layers 70.8 vs 72.1 GiB (tests/test_ui.py checks these).

The run plan (workbench/plan/memory.py) takes its activations, gathers and logits and adds what the engine's step
holds at its peak instead of this sum of everything at once; the Studio imports both names from workbench.ui.memory.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from workbench.config import OPTIMIZER_STATES
from workbench.devices import resolve_dtype_name
from workbench.mixer_counts import mixer_counts
from workbench.models.families import LayerBlocks, family_for
from workbench.models.families.family import no_expert_rows
from workbench.models.lora_check import adapter_counts
from workbench.params import ParamCounts, experts_input_width, head_dims, is_mla, layer_blocks, param_counts

GIB = float(1 << 30)
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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


def _attention_per_token(cfg: Any) -> int:
    heads = cfg.num_attention_heads
    qk, v = head_dims(cfg)
    if is_mla(cfg):
        # q, k, v and the output at every head; the low-rank projections' outputs and their norms' outputs (kv_a's
        # output holds the latent and the shared rope key)
        return (
            heads * (2 * qk + 2 * v)
            + 2 * cfg.kv_lora_rank
            + cfg.qk_rope_head_dim
            + 2 * (getattr(cfg, "q_lora_rank", None) or 0)
        )
    family = family_for(getattr(cfg, "model_type", ""))
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    # the attention's q, k, v (after the rotary embedding) and output; q/k norms keep their inputs too (the fused
    # norm + rope's backward reads the projections' outputs)
    norms = (heads + kv_heads) * qk if family.qk_norm else 0
    # a gated query: its gate half (in the query projection's output), the sigmoid and the gated output
    gate = 3 * heads * qk if family.gated_query else 0
    return 2 * heads * qk + 2 * kv_heads * qk + norms + gate


def rows_take_weights(cfg: Any, ep: int) -> bool:
    """Whether the engine's experts apply the routing weights in their SwiGLU (moe/row_weights.py), so the combine
    keeps no expert outputs: a plain SwiGLU gate with bias-free experts and the family's generic rows, under the
    one-rank dispatcher (ep 1: the only one whose rows take their weights)."""
    family = family_for(getattr(cfg, "model_type", ""))
    plain = family.gated_mlps and not family.biased_experts and family.expert_rows is no_expert_rows
    return ep == 1 and plain


def _per_token_layer(cfg: Any, counts: ParamCounts, blocks: LayerBlocks, ep: int = 1) -> float:
    """Activation elements one token keeps for backward in one decoder layer (module docstring); `ep`: the mesh's
    (whether the combine keeps the experts' outputs)."""
    hidden = counts.hidden
    gated = 3 if family_for(getattr(cfg, "model_type", "")).gated_mlps else 2
    # each block keeps its input (the residual stream) and its norm's output, the input of every projection, router
    # and expert that follows (one tensor, kept once)
    total = 2 * hidden * ((blocks.mixer is not None) + (blocks.mlp is not None))
    if blocks.mixer == "attention":
        total += _attention_per_token(cfg)
    elif blocks.mixer is not None:
        total += mixer_counts(cfg, blocks.mixer).activations_per_token
    if blocks.mlp == "moe":
        width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
        routed = experts_input_width(cfg)  # a LatentMoE's experts work at the latent width
        # each routed copy keeps its input row and its g*I gate/up and activation (the SwiGLU's packed gate/up and
        # the down projection's input); its output only where the combine weighs the rows (it reads them back for
        # the weights' gradient). Counting every copy's output and a 2H router input (20K elements a token at
        # Qwen3-30B-A3B) put the plan 23-24% over what the engine saves (tests/test_plan_activations.py).
        copy = routed + gated * width + (0 if rows_take_weights(cfg, ep) else routed)
        total += counts.num_experts + counts.top_k * copy  # the router's probabilities, the routed copies
        if counts.latent_per_layer:  # the combined latent rows, fc2_latent_proj's input
            total += routed
        if counts.shared_per_layer:  # g * I_s; a sigmoid-gated shared expert keeps its output for the gate
            total += counts.shared_per_layer // hidden + hidden * family_for(cfg.model_type).shared_expert_gate
    elif blocks.mlp == "dense":
        total += gated * cfg.intermediate_size
    return total


def _largest_layer(counts: ParamCounts, blocks: tuple[LayerBlocks, ...], ep: int) -> float:
    """Parameters of the largest decoder layer, with this rank's E/ep experts (the one gathered at a time)."""
    mixers = {"attention": counts.attention_per_layer, None: 0}
    mlps = {
        "moe": counts.router_per_layer
        + counts.shared_per_layer
        + counts.latent_per_layer
        + counts.experts_per_layer / ep,
        "dense": counts.dense_mlp_per_layer,
        None: 0,
    }
    return max(mixers.get(b.mixer, counts.mixer_per_layer) + mlps[b.mlp] for b in blocks)


def resolve_dtype(dtype: str, device_type: str) -> str:
    """What `dtype` trains in on `device_type` (the trainer's rule: train/model_setup), of the sizes known here."""
    name = resolve_dtype_name(dtype, device_type)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {['auto', *DTYPE_BYTES]}")
    return name


def estimate_memory(
    cfg: Any,
    dp: int,
    ep: int,
    *,
    seq_len: int,
    local_batch: int,
    dtype: str = "auto",
    device_type: str = "cuda",
    activation_checkpointing: bool = False,
    checkpointed_layers: int | None = None,
    fused_ce: bool = False,
    lora=None,
    optimizer_states: str = "full",
) -> MemoryEstimate:
    """Estimated memory of one rank training `cfg` on a dp x ep mesh (documented above; `lora`: LoRA's;
    `optimizer_states`: train.optimizer_states; `checkpointed_layers`: with activation_checkpointing, how many
    layers recompute, the first ones; None: all)."""
    if optimizer_states not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer_states must be one of {OPTIMIZER_STATES}, got {optimizer_states!r}")
    if dp < 1 or ep < 1 or dp % ep:
        raise ValueError(f"need dp >= 1 and ep dividing dp, got dp={dp}, ep={ep}")
    counts = param_counts(cfg)
    if counts.num_experts and counts.num_experts % ep:
        raise ValueError(f"ep={ep} does not divide the model's {counts.num_experts} experts")
    b = DTYPE_BYTES[resolve_dtype(dtype, device_type)]
    edp = dp // ep
    # param + grad + AdamW's two moments; 8-bit moments: a byte each plus the scales (blocks of 64 at the least
    # that the engine's families use: 2880 = 45 * 64 for GPT-OSS, 256 for most)
    moments = 2 * b if optimizer_states == "full" else 2 + 8 / 64
    per_param = 2 * b + moments
    adapters = lora_adapters = 0
    if lora is not None:
        dense_adapters, expert_adapters, lora_adapters = adapter_counts(cfg, lora)
        adapters = (dense_adapters + expert_adapters) / dp * (2 * b + moments)
        per_param = b  # the frozen base: its weights only
    sharded = (counts.dense / dp + counts.experts / (ep * edp)) * per_param + adapters
    blocks = layer_blocks(cfg)
    gathered = 0.0
    if dp > 1:
        layer = _largest_layer(counts, blocks, ep)
        root, layers = (1, 2) if lora is not None else (2, 3)  # a frozen base gathers no gradient
        gathered = b * (root * (counts.embed + counts.lm_head) + layers * layer)
    per_layer = [_per_token_layer(cfg, counts, one, ep) for one in blocks]
    tokens = seq_len * local_batch
    if activation_checkpointing:
        # a recomputed layer keeps its input; the backward holds one recomputed layer's activations at a time
        n = len(per_layer) if checkpointed_layers is None else min(checkpointed_layers, len(per_layer))
        kept = sum(per_layer[n:])
        activations = tokens * b * (n * counts.hidden + kept + (max(per_layer[:n]) if n else 0))
    else:
        activations = tokens * b * sum(per_layer)
    if lora is not None:
        activations += tokens * b * lora.rank * lora_adapters  # x @ A of each adapter a token passes
    logits = 0.0 if fused_ce else tokens * cfg.vocab_size * (b + 8)
    return MemoryEstimate(sharded_state=sharded, gathered=gathered, activations=activations, logits=logits)
