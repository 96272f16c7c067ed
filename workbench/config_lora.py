"""The lora section of a RunConfig: frozen base weights, low-rank adapters on chosen targets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from workbench.config_checks import ConfigError, check_float, check_int, check_keys

# What LoRA can adapt (workbench/models/lora_targets.py finds each in a model): the attention projections
# (MLA's too), the projections of a hybrid's other sequence mixers (Mamba2, Gated DeltaNet: in_proj, out_proj), the
# routed experts' fused gate/up and down weights, shared experts, the MLPs of dense layers, and the router's gate
# where it is an nn.Linear.
LORA_TARGETS = ("attention", "mixer", "experts", "shared_experts", "dense_mlp", "router")


@dataclass(frozen=True)
class LoraConfig:
    """LoRA fine-tuning: frozen base weights, low-rank adapters (B zero-initialized) on `targets`.

    The section's presence turns LoRA on (RunConfig.lora None = full fine-tuning); `--set lora.rank=16`
    adds it. The update of a weight W is (alpha / rank) * A @ B; dropout acts on the adapters' input.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("attention", "experts")

    def __post_init__(self) -> None:
        check_int(self.rank, "lora.rank", 1)
        check_float(self.alpha, "lora.alpha", 0.0)
        if self.alpha == 0:
            raise ConfigError("lora.alpha must be > 0 (0 scales every adapter to nothing); the usual is 2 x rank")
        check_float(self.dropout, "lora.dropout", 0.0, 1.0)
        if self.dropout == 1:
            raise ConfigError("lora.dropout must be < 1 (1 drops every adapter input)")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        if not isinstance(targets, (tuple, list)) or not targets or not all(isinstance(t, str) for t in targets):
            raise ConfigError(f"lora.targets must be a non-empty list from {list(LORA_TARGETS)}, got {self.targets!r}")
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            raise ConfigError(f"lora.targets {unknown} unknown; choose from {list(LORA_TARGETS)}")
        if len(set(targets)) != len(targets):
            raise ConfigError(f"lora.targets lists a target twice: {list(targets)}")
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))
        object.__setattr__(self, "targets", tuple(targets))

    @property
    def scaling(self) -> float:
        """The factor of every adapter's output: alpha / rank (PEFT's, without rsLoRA)."""
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able mapping."""
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout, "targets": list(self.targets)}


def lora_from_dict(data: Any) -> LoraConfig | None:
    """The lora section from a mapping (or a LoraConfig, or None: full fine-tuning)."""
    if data is None or isinstance(data, LoraConfig):
        return data
    check_keys(LoraConfig, data, "lora")
    return LoraConfig(**data)
