"""One rank's peak memory, by part, before anything is built (bytes; b = bytes per element of the training dtype).

    weights           (dense / dp + experts / (ep * edp)) * b         # workbench.params; a LoRA's frozen base too
    master_weights    4 bytes per trainable parameter with train.precision fp32_master on a bf16 model
    optimizer_states  AdamW's two moments per trainable parameter: 2b ("full"), 8 with fp32_master,
                      2 + 8/64 with optimizer_states "8bit" (a byte each and a float32 scale per block)
    lora              the adapters: weights, gradients and moments (counted on the meta model)
    fsdp_gathers      dp > 1: the unsharded root and the gathered layer, its prefetch (and its gradient)
    activations       what the backward keeps, per layer with or without activation checkpointing, plus a LoRA
                      adapter's rank-wide inputs (workbench/plan/estimate.py's per-token formula, every family)
    logits            the full logits with their float32 upcast and gradient; 0 with the fused cross-entropy
                      (backend.fused_ce, read from the config)
    gradients         the gradients alive at the peak (below)
    cuda_graph_pool   train.cuda_graphs: the captured stack's private pool holds its activations
    allocator_slack   SLACK_FRACTION of the step's transient part plus SLACK_GIB on CUDA (the caching allocator's
                      fragmentation, cuBLAS and attention workspaces)

When the peak happens: the gradients of the last step are freed before the forward (zero_grad to None), so the
backward starts with every activation alive and only the first gradients (the LM head's, and the last layer's,
written before that layer's activations are freed), and ends with every gradient and no activation; the peak is the
larger of the two (with updates inside the backward only one layer's gradients live at a time; with gradient
accumulation the earlier micro-batches' gradients sit beside the next forward). The parts above are those at the
peak, so they sum to it. Measured on one H200 / H100 (the rows of benchmarks/results/plan-vs-measured.json): within
10% of the peak allocated by the trainer's step.
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.params import ParamCounts, param_counts
from workbench.plan.estimate import estimate_memory
from workbench.plan.shape import RunShape

GIB = float(1 << 30)
SLACK_FRACTION = 0.04
SLACK_GIB = 0.25
PARTS = (
    "weights",
    "master_weights",
    "optimizer_states",
    "lora",
    "fsdp_gathers",
    "activations",
    "logits",
    "gradients",
    "cuda_graph_pool",
    "allocator_slack",
)


@dataclass(frozen=True)
class MemoryParts:
    """Bytes on one rank at its peak, by part (the module docstring); `peak` is their sum."""

    weights: float
    master_weights: float
    optimizer_states: float
    lora: float
    fsdp_gathers: float
    activations: float
    logits: float
    gradients: float
    cuda_graph_pool: float
    allocator_slack: float

    @property
    def peak(self) -> float:
        return sum(getattr(self, name) for name in PARTS)

    def as_gib(self) -> dict[str, float]:
        return {name: getattr(self, name) / GIB for name in PARTS}


def moment_bytes(shape: RunShape) -> float:
    """Bytes of AdamW's two moments per trainable parameter."""
    if shape.optimizer_states == "8bit":
        return 2 + 8 / 64
    if shape.dtype_bytes == 2 and shape.precision == "fp32_master":
        return 8.0
    return 2.0 * shape.dtype_bytes


def _largest_layer_params(counts: ParamCounts, ep: int) -> float:
    """One decoder layer's parameters with this rank's experts (the gradients alive under updates in the backward)."""
    mixer = max(counts.attention_per_layer, counts.mixer_per_layer)
    mlp = max(
        counts.router_per_layer + counts.shared_per_layer + counts.experts_per_layer / ep,
        counts.dense_mlp_per_layer,
    )
    return mixer + mlp


def memory_parts(shape: RunShape) -> MemoryParts:
    """The parts of one rank's peak (module docstring)."""
    cfg, b = shape.hf_config, shape.dtype_bytes
    counts = param_counts(cfg)
    dp, ep = shape.dp, shape.ep
    edp = dp // ep
    on_rank = counts.dense / dp + counts.experts / (ep * edp)
    estimate = estimate_memory(
        cfg,
        dp,
        ep,
        seq_len=shape.seq_len,
        local_batch=shape.local_batch,
        dtype=shape.dtype,
        device_type="cuda",  # the dtype is resolved already
        activation_checkpointing=shape.activation_checkpointing,
        checkpointed_layers=shape.checkpointed_layers,
        fused_ce=shape.fused_ce,
        lora=None,  # the adapters' share is counted below, from the cached meta-model count
    )
    activations, gathered = estimate.activations, estimate.gathered
    moments = moment_bytes(shape)
    master = 4.0 if (b == 2 and shape.precision == "fp32_master") else 0.0
    if shape.lora is not None:
        dense_adapters, expert_adapters, passed = shape.adapters
        trainable = (dense_adapters + expert_adapters) / dp
        lora = trainable * (2 * b + moments + master)
        activations += shape.tokens * b * shape.lora.rank * passed  # each adapter's x @ A
        if dp > 1:  # a frozen base gathers no gradient: its root once, two layers
            gathered -= b * ((counts.embed + counts.lm_head) + _largest_layer_params(counts, ep))
        weights, optimizer, master_weights, grads_all, grads_first, grads_layer = on_rank * b, 0.0, 0.0, 0.0, 0.0, 0.0
    else:
        lora = 0.0
        weights = on_rank * b
        optimizer = on_rank * moments
        master_weights = on_rank * master
        grads_all = on_rank * b
        grads_first = (counts.lm_head or counts.embed) / dp * b
        grads_layer = _largest_layer_params(counts, ep) / max(edp, 1) * b
    logits = estimate.logits
    # train.cuda_graphs: the captured stack's private pool keeps its activations whether or not a step runs
    pool = activations if shape.cuda_graphs else 0.0
    transient = activations - pool
    if shape.optimizer_in_backward:
        at_peak = {"activations": transient, "logits": logits, "gradients": grads_first + grads_layer}
    elif shape.accum > 1:
        at_peak = {"activations": transient, "logits": logits, "gradients": grads_all}
    # the last layer's weight gradients are written while every activation is still alive (the activation formula
    # counts what autograd saves and no more: measured at Qwen3-30B-A3B L8 16384 x 1 on the H200, 49.9 GiB, the plan
    # without them was 6% under)
    elif transient + logits + grads_first + grads_layer >= grads_all:
        at_peak = {"activations": transient, "logits": logits, "gradients": grads_first + grads_layer}
    else:
        at_peak = {"activations": 0.0, "logits": 0.0, "gradients": grads_all}
    dynamic = sum(at_peak.values()) + pool
    return MemoryParts(
        weights=weights,
        master_weights=master_weights,
        optimizer_states=optimizer,
        lora=lora,
        fsdp_gathers=max(gathered, 0.0),
        activations=at_peak["activations"],
        logits=at_peak["logits"],
        gradients=at_peak["gradients"],
        cuda_graph_pool=pool,
        allocator_slack=SLACK_FRACTION * dynamic + (SLACK_GIB * GIB if shape.device_type == "cuda" else 0.0),
    )
