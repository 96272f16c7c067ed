"""One optimizer step's time on one rank, predicted from FLOPs and throughputs (workbench/plan/throughputs.py).

Per micro-batch of T tokens (seq_len x local batch) on a rank:
    GEMM passes   p = 2 (forward) + 2 (input gradients) + 2 (weight gradients, trainable weights only: not a LoRA's
                  frozen base) + 2 (activation checkpointing's recomputed forward)
    dense         p * T * (active matmul weights - the routed experts')  / dense GEMM throughput
    experts       p * T * top_k * expert weights * MoE layers             / grouped GEMM at T k / E rows per expert
    attention     (6 + 2 with checkpointing) / 6 * T * the attention term of workbench.flops / attention(seq_len)
    mixers        the same for Mamba2's scan and the gated delta rule     / mixer throughput
    LoRA          p' * T * rank * 2 H per adapter a token passes          / dense GEMM throughput
    memory-bound  MEMORY_PASSES x the activations' bytes (written forward, read backward, their gradients; the
                  recompute once more)                                    / memory bandwidth
    host          layers x passes x (host ms per layer + per adapter): the step cannot go faster than its launches
                  (no floor with train.cuda_graphs, which replays the stack)
    micro-batch = max(GPU time, host time)
Per step: accum micro-batches, then AdamW over the trainable parameters on the rank, memory-bound at
OPTIMIZER_BYTES per parameter (14 bytes read and written in bf16 plus the clipping norm's read; 30 with fp32_master;
8-bit moments cost the same time: fewer bytes, more arithmetic); on dp > 1 the FSDP gathers and reductions and the
expert all-to-all over the GPU links, of which EXPOSED_COMM is not hidden behind compute (not yet measured against a
multi-GPU step).
"""

from __future__ import annotations

from dataclasses import dataclass

from workbench.flops import attention_layer_flops
from workbench.mixer_counts import mixer_counts
from workbench.params import layer_blocks, param_counts
from workbench.plan.estimate import estimate_memory
from workbench.plan.shape import RunShape
from workbench.plan.throughputs import Throughputs

MEMORY_PASSES = 4.0
OPTIMIZER_BYTES = {"full": 16.0, "8bit": 23.0, "fp32_master": 30.0}
LORA_PASSES = 4
EXPOSED_COMM = 0.5
TIME_PARTS = ("dense", "experts", "attention", "mixers", "lora", "memory", "host_wait", "optimizer", "communication")


@dataclass(frozen=True)
class StepTime:
    """Seconds of one optimizer step on one rank, by part (module docstring); `step_s` is their sum."""

    dense: float
    experts: float
    attention: float
    mixers: float
    lora: float
    memory: float
    host_wait: float  # what the launches add beyond the GPU's work
    optimizer: float
    communication: float
    tokens_per_step: int  # this rank's tokens in one optimizer step

    @property
    def step_s(self) -> float:
        return sum(getattr(self, name) for name in TIME_PARTS)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s if self.step_s > 0 else 0.0

    def as_dict(self) -> dict[str, float]:
        return {name: getattr(self, name) for name in TIME_PARTS}


def step_time(shape: RunShape, tp: Throughputs) -> StepTime:
    """The predicted step of `shape` on a GPU with throughputs `tp` (module docstring)."""
    cfg = shape.hf_config
    counts = param_counts(cfg)
    T = shape.tokens
    frozen_base = shape.lora is not None
    ac = shape.recompute_fraction  # the share of the layers whose forward runs again in the backward
    passes = 4 + (0 if frozen_base else 2) + 2 * ac
    expert_weights = counts.moe_layers * counts.top_k * counts.expert_matmul
    dense = passes * T * (counts.active_matmul - expert_weights) / (tp.dense_tflops * 1e12)
    experts = 0.0
    if expert_weights:
        rows = T * counts.top_k / max(counts.num_experts, 1)  # the average expert's rows (EP moves rows, not averages)
        experts = passes * T * expert_weights / (tp.grouped(rows) * 1e12)
    recompute = (6 + 2 * ac) / 6
    # each attention layer at the throughput of its span of keys (2 x keys per query: S under the causal mask, about
    # twice the window on a sliding-window layer, where the tiles are few and the kernel far from its peak)
    attention = sum(
        recompute * T * flops / (tp.attention(2 * keys) * 1e12)
        for flops, keys in attention_layer_flops(cfg, shape.seq_len)
    )
    mixers = 0.0
    for blocks in layer_blocks(cfg):
        if blocks.mixer not in ("attention", None):
            mixers += recompute * T * mixer_counts(cfg, blocks.mixer).flops_per_token / (tp.mixer(blocks.mixer) * 1e12)
    b = shape.dtype_bytes
    lora = 0.0
    adapters_passed = 0
    if frozen_base:
        # the adapters' skinny GEMMs (rank-wide) are memory-bound: each pass reads and writes its input and output
        # widths once, LORA_PASSES times a step (twice more with the recompute)
        dense_adapters, expert_adapters, adapters_passed = shape.adapters
        widths = (dense_adapters + counts.top_k * expert_adapters / max(counts.num_experts, 1)) / shape.lora.rank
        lora = (LORA_PASSES + 2 * ac) * T * widths * b / (tp.memory_gbps * 1e9)
    saved = estimate_memory(
        cfg,
        shape.dp,
        shape.ep,
        seq_len=shape.seq_len,
        local_batch=shape.local_batch,
        dtype=shape.dtype,
        fused_ce=shape.fused_ce,
    )
    memory = MEMORY_PASSES * (1.0 + 0.25 * ac) * (saved.activations + saved.logits) / (tp.memory_gbps * 1e9)
    gpu = dense + experts + attention + mixers + lora + memory
    host_wait = 0.0
    if not shape.cuda_graphs:
        layer_passes = counts.layers * (2 + ac)
        adapters_per_layer = adapters_passed / max(counts.layers, 1)
        host = layer_passes * (tp.host_ms_per_layer + adapters_per_layer * tp.host_ms_per_adapter) / 1e3
        host_wait = max(0.0, host - gpu)
    on_rank = counts.dense / shape.dp + counts.experts / (shape.ep * (shape.dp // shape.ep))
    if frozen_base:
        dense_adapters, expert_adapters, _ = shape.adapters
        trainable = (dense_adapters + expert_adapters) / shape.dp
    else:
        trainable = on_rank
    mode = "fp32_master" if (shape.dtype_bytes == 2 and shape.precision == "fp32_master") else shape.optimizer_states
    optimizer = trainable * OPTIMIZER_BYTES[mode] / (tp.memory_gbps * 1e9)
    communication = 0.0
    if shape.dp > 1 and tp.link_gbps > 0:
        edp = shape.dp // shape.ep
        # FSDP: gather the dense weights twice (forward, backward) and reduce their gradients, over dp; the experts the
        # same over edp; the expert all-to-all: 4 exchanges of the routed rows per MoE layer, (ep-1)/ep of them remote
        fsdp = 3 * b * (counts.dense * (shape.dp - 1) / shape.dp + counts.experts / shape.ep * (edp - 1) / edp)
        if frozen_base:
            fsdp *= 2 / 3  # a frozen base reduces no gradient
        a2a = 4 * counts.moe_layers * T * counts.top_k * counts.hidden * b * (shape.ep - 1) / shape.ep
        communication = EXPOSED_COMM * (fsdp + shape.accum * a2a) / (tp.link_gbps * 1e9)
    accum = shape.accum
    return StepTime(
        dense=accum * dense,
        experts=accum * experts,
        attention=accum * attention,
        mixers=accum * mixers,
        lora=accum * lora,
        memory=accum * memory,
        host_wait=accum * host_wait,
        optimizer=optimizer,
        communication=communication,
        tokens_per_step=accum * T,
    )
