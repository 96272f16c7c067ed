"""What a plan needs from a RunConfig, resolved for a rank count and a device type: the model's config, the mesh,
the tokens of one micro-batch, the dtype and the memory-related settings (nothing is built)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.config import RunConfig
from workbench.devices import resolve_dtype_name
from workbench.models.fused_ce import fused_ce_support
from workbench.models.lora_check import adapter_counts
from workbench.models.mesh_choice import resolve_mesh

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class RunShape:
    """One rank's share of a run, as the memory and step-time formulas read it."""

    hf_config: Any
    device_type: str  # "cuda" or "cpu"
    gpus: int
    dp: int
    ep: int
    seq_len: int
    local_batch: int
    accum: int  # micro-batches per optimizer step
    dtype: str  # "bfloat16" | "float32" | "float16"
    precision: str  # train.precision ("auto" = bf16_sr)
    optimizer_states: str
    activation_checkpointing: bool
    checkpointed_layers: int  # decoder layers recomputed in the backward (0 without activation checkpointing)
    optimizer_in_backward: bool
    cuda_graphs: bool
    fused_ce: bool
    lora: Any  # LoraConfig or None
    adapters: tuple[int, int, int] | None  # a LoRA's adapter_counts (dense, experts, adapters a token passes)

    @property
    def recompute_fraction(self) -> float:
        """The share of the decoder layers whose forward runs again in the backward."""
        layers = getattr(self.hf_config, "num_hidden_layers", 0) or 0
        return min(self.checkpointed_layers / layers, 1.0) if layers else float(self.activation_checkpointing)

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch on one rank."""
        return self.seq_len * self.local_batch


def checkpointed_layers(rc: RunConfig, hf_config: Any) -> int:
    """How many decoder layers `rc` recomputes in the backward: none, train.activation_checkpointing_layers, or all."""
    if not rc.train.activation_checkpointing:
        return 0
    layers = getattr(hf_config, "num_hidden_layers", 0) or 0
    wanted = rc.train.activation_checkpointing_layers
    return layers if wanted is None else min(wanted, layers)


def fused_ce(backend: Any, hf_config: Any) -> bool:
    """Whether the loss runs the fused linear cross-entropy (no full logits): a resolved BackendConfig says; "auto"
    (not yet resolved for the model) is the model's answer, as BackendConfig.resolve would make it."""
    value = backend.fused_ce
    if isinstance(value, bool):
        return value
    return fused_ce_support(hf_config)[0]


def run_shape(
    rc: RunConfig,
    gpus: int,
    device_type: str,
    hf_config: Any = None,
    adapters: dict | None = None,
    backend: Any = None,
) -> RunShape:
    """`rc` on `gpus` ranks of `device_type` ("cuda" or "cpu"); ConfigError where the trainer would refuse the mesh or
    the batch sizes for that rank count. `backend`: rc.backend resolved for the device (the trainer's). `adapters`:
    LoraConfig -> adapter_counts already counted for this model (the count builds a meta model: ~0.1 s at 48
    layers)."""
    hf_config = rc.model.hf_config() if hf_config is None else hf_config
    counted = None
    if rc.lora is not None:
        adapters = {} if adapters is None else adapters
        if rc.lora not in adapters:
            adapters[rc.lora] = adapter_counts(hf_config, rc.lora)
        counted = adapters[rc.lora]
    mesh = resolve_mesh(rc.mesh, gpus, hf_config)
    dp, ep = (mesh.dp, mesh.ep) if mesh is not None else (gpus, 1)
    return RunShape(
        hf_config=hf_config,
        device_type=device_type,
        gpus=gpus,
        dp=dp,
        ep=ep,
        seq_len=rc.data.seq_len,
        local_batch=rc.train.local_batch_size,
        accum=rc.train.accumulation_steps(dp),
        dtype=resolve_dtype_name(rc.model.dtype, device_type),
        precision=rc.train.precision,
        optimizer_states=rc.train.optimizer_states,
        activation_checkpointing=rc.train.activation_checkpointing,
        checkpointed_layers=checkpointed_layers(rc, hf_config),
        optimizer_in_backward=rc.train.optimizer_in_backward,
        cuda_graphs=rc.train.cuda_graphs,
        fused_ce=fused_ce(rc.backend if backend is None else backend, hf_config),
        lora=rc.lora,
        adapters=counted,
    )
