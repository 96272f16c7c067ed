"""BenchConfig: what one `workbench bench` launch measures, validated before any heavy work."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

from workbench.backends import CHOICES, BackendConfig
from workbench.config import OPTIMIZER_STATES, OPTIMIZERS, PRECISIONS, PRESETS, ConfigError, preset_config
from workbench.parallel.mesh import MeshConfig
from workbench.runs.run_dir import default_runs_dir


@dataclass(frozen=True)
class VariantSpec:
    """One side of the comparison: the Transformers anchor or the engine, with its options."""

    kind: str  # "anchor" | "engine"
    help: str
    experts_implementation: str = "grouped_mm"  # anchor only: Transformers' experts path
    sdpa_backend: str | None = None  # anchor only: force a torch SDPA backend ("cudnn")
    gate: str = "native"  # engine only
    needs_cuda: bool = False
    backend: tuple[tuple[str, str | bool], ...] = ()  # engine only: BackendConfig fields this variant sets
    attn_implementation: str = "sdpa"  # anchor only: Transformers' attention ("sdpa", "eager", "flex_attention")
    cuda_reason: str = ""  # why a needs_cuda variant is skipped elsewhere ("" = the cuDNN SDPA reason)
    precision: str | None = None  # engine only: train.precision of its AdamW; None = the launch's BenchConfig.precision
    optimizer: str = (
        "adamw"  # engine only: train.optimizer ("adamw": Triton on CUDA); every anchor runs torch's fused AdamW
    )
    liger: bool = False  # anchor only: Liger kernels patched onto the Transformers model (workbench.bench.liger)
    optimizer_in_backward: bool = False  # engine only: train.optimizer_in_backward (then without clipping)
    adamw_multi_numel: int | None = None  # engine only: TritonAdamW.multi_tensor_numel (None: its default)
    cuda_graphs: bool = False  # engine only: train.cuda_graphs (the decoder stack replayed as CUDA graphs)
    activation_checkpointing: bool = False  # engine only: train.activation_checkpointing
    optimizer_states: str = "full"  # engine only: train.optimizer_states ("8bit": one-byte AdamW moments)

    def __post_init__(self) -> None:
        if self.kind not in ("anchor", "engine"):
            raise ConfigError(f"variant kind must be 'anchor' or 'engine', got {self.kind!r}")
        if self.attn_implementation not in ANCHOR_ATTENTION:
            raise ConfigError(
                f"variant attn_implementation {self.attn_implementation!r} is not one of {list(ANCHOR_ATTENTION)}"
            )
        if self.sdpa_backend is not None and self.attn_implementation != "sdpa":
            raise ConfigError(f"variant sdpa_backend={self.sdpa_backend!r} needs attn_implementation='sdpa'")
        if self.precision is not None and (self.kind != "engine" or self.precision not in PRECISIONS):
            raise ConfigError(f"variant precision {self.precision!r} must be one of {PRECISIONS}, on an engine variant")
        if self.optimizer not in OPTIMIZERS or (self.kind != "engine" and self.optimizer != "adamw"):
            raise ConfigError(f"variant optimizer {self.optimizer!r} must be one of {OPTIMIZERS}, on an engine variant")
        if self.optimizer_states not in OPTIMIZER_STATES or (self.kind != "engine" and self.optimizer_states != "full"):
            raise ConfigError(
                f"variant optimizer_states {self.optimizer_states!r} must be one of {OPTIMIZER_STATES}, "
                "on an engine variant"
            )
        for flag in ENGINE_TRAIN_FLAGS:  # train settings of the engine's trainer
            if getattr(self, flag) and self.kind != "engine":
                raise ConfigError(
                    f"variant {flag}=True runs the engine's trainer (train.{flag}): an engine variant only"
                )
        if self.adamw_multi_numel is not None and (
            self.kind != "engine" or not isinstance(self.adamw_multi_numel, int) or self.adamw_multi_numel < 0
        ):
            raise ConfigError(
                f"variant adamw_multi_numel {self.adamw_multi_numel!r} must be an integer >= 0, on an engine variant"
            )
        if self.liger and self.kind != "anchor":
            raise ConfigError("variant liger=True patches a Transformers model: an anchor variant only")
        for key, value in self.backend:
            ok = (
                (value in CHOICES[key] and key != "gate")
                if key in CHOICES
                else (key in ("fused_ce", "expert_recompute", "fp8") and isinstance(value, bool))
                or (key == "fused_ce" and value == "auto")
                or (key == "dispatch_chunks" and type(value) is int and value >= 1)
            )
            if not ok:
                raise ConfigError(f"variant backend override {key}={value!r} is not a BackendConfig choice")


# VariantSpec's flags that are TrainConfig fields of the same name, for engine variants only
ENGINE_TRAIN_FLAGS = ("optimizer_in_backward", "cuda_graphs", "activation_checkpointing")

# Transformers' attention implementations an anchor may use (all ship with torch; flash_attention_2 is not installed).
ANCHOR_ATTENTION = ("sdpa", "eager", "flex_attention")
LIGER_CUDA_REASON = "Liger's Triton kernels need a CUDA GPU (liger-kernel imports on CPU but cannot run there)"
FLEX_REASON = (
    "Transformers' flex_attention anchor is measured on CUDA only (on CPU it compiles through inductor, "
    "and GPT-OSS's attention sinks refuse it there)"
)

# The registry of variants; names are what --variants and the JSON rows use. The speedups of a
# launch are reported against its best (fastest) anchor row that ran: families differ in which
# attention Transformers runs for them (GPT-OSS refuses sdpa: attention sinks).
VARIANTS: dict[str, VariantSpec] = {
    "anchor": VariantSpec("anchor", "Transformers v5: grouped_mm experts, sdpa, FSDP2 per decoder layer"),
    "anchor_flex": VariantSpec(
        "anchor",
        "the anchor with Transformers' flex_attention (compiled)",
        attn_implementation="flex_attention",
        needs_cuda=True,
        cuda_reason=FLEX_REASON,
    ),
    "anchor_eager_attn": VariantSpec(
        "anchor", "the anchor with Transformers' eager attention", attn_implementation="eager"
    ),
    "anchor_batched_mm": VariantSpec(
        "anchor",
        "the anchor with batched_mm experts (gathers each token's expert weights: small models only)",
        experts_implementation="batched_mm",
    ),
    "anchor_liger": VariantSpec(
        "anchor",
        "the anchor with Liger kernels (fused linear CE, RMSNorm, RoPE, SwiGLU "
        "experts where liger-kernel has them for the family)",
        liger=True,
        needs_cuda=True,
        cuda_reason=LIGER_CUDA_REASON,
    ),
    "engine": VariantSpec("engine", "MoE Workbench engine, native router", gate="native"),
    "engine_balanced": VariantSpec("engine", "MoE Workbench engine, balanced gate", gate="balanced"),
    "anchor_cudnn": VariantSpec(
        "anchor", "the anchor with torch's cuDNN SDPA backend forced", sdpa_backend="cudnn", needs_cuda=True
    ),
    "anchor_eager": VariantSpec(
        "anchor", "the anchor with eager (v4-style loop) experts", experts_implementation="eager"
    ),
    # the hybrid models (Nemotron-H, Qwen3.5-MoE, Qwen3-Next): what the engine's chunked sequence mixers add
    "engine_triton_mixer": VariantSpec(
        "engine",
        "engine with the gated delta rule's chunk walk in Triton (BackendConfig.mixer='triton'; Mamba2 keeps the "
        "compiled chunked scan)",
        backend=(("mixer", "triton"),),
    ),
    "engine_chunked_mixer": VariantSpec(
        "engine",
        "engine with the gated delta rule's chunk walk as a loop of torch.compile'd chunk blocks "
        "(BackendConfig.mixer='chunked', the CPU's path)",
        backend=(("mixer", "chunked"),),
    ),
    "engine_transformers_mixer": VariantSpec(
        "engine",
        "engine with Transformers' own sequence mixers (Mamba2, Gated DeltaNet: BackendConfig.mixer='transformers')",
        backend=(("mixer", "transformers"),),
    ),
    # the engine with full logits: what the fused cross-entropy (on by default where the model allows) is worth
    "engine_no_fused_ce": VariantSpec(
        "engine",
        "engine, the loss from full [tokens, vocab] logits (BackendConfig.fused_ce=False)",
        backend=(("fused_ce", False),),
    ),
    "engine_recompute": VariantSpec(
        "engine", "engine, expert MLPs recomputed in backward (memory)", backend=(("expert_recompute", True),)
    ),
    # Optional accelerators: skipped with the reason where the package or device is missing.
    "engine_te": VariantSpec(
        "engine",
        "engine, TransformerEngine attention, linear and RMSNorm",
        backend=(("attention", "te"), ("linear", "te"), ("rms_norm", "te")),
    ),
    "engine_te_experts": VariantSpec(
        "engine", "engine, TransformerEngine grouped-GEMM experts", backend=(("experts", "te"),)
    ),
    "engine_te_fp8": VariantSpec(
        "engine",
        "engine, TransformerEngine linear layers in FP8 (current scaling)",
        backend=(("linear", "te"), ("fp8", True)),
    ),
    "engine_symm_mem": VariantSpec(
        "engine", "engine, symm_mem (NVSHMEM all_to_all_vdev) dispatcher", backend=(("dispatcher", "symm_mem"),)
    ),
    "engine_deepep": VariantSpec("engine", "engine, DeepEP dispatcher", backend=(("dispatcher", "deepep"),)),
    # the all-to-all in 2 token chunks pipelined with the expert GEMMs, beside `engine`'s plain alltoall (ep >= 2)
    "engine_alltoall_overlap": VariantSpec(
        "engine",
        "engine, alltoall_overlap dispatcher (2 token chunks, each one's all-to-all beside the other's expert GEMMs)",
        backend=(("dispatcher", "alltoall_overlap"), ("dispatch_chunks", 2)),
    ),
    # train.precision per row (workbench.train.precision): tokens/s and memory of each mode in one launch
    # torch's fused AdamW (as the anchors) on the engine: isolates what the optimizer kernel adds
    "engine_adamw_torch": VariantSpec(
        "engine", "engine with torch's fused AdamW (bf16, as the anchor)", optimizer="adamw_torch", precision="bf16"
    ),
    "engine_bf16": VariantSpec(
        "engine", "engine, pure bf16 AdamW (round to nearest: loses small updates)", precision="bf16"
    ),
    "engine_bf16_sr": VariantSpec("engine", "engine, bf16 AdamW with stochastic rounding", precision="bf16_sr"),
    "engine_in_backward": VariantSpec(
        "engine",
        "engine, each parameter updated inside the backward (one layer's gradients alive; no clipping)",
        optimizer_in_backward=True,
    ),
    # the Triton AdamW with one launch per tensor: what its multi-tensor launches (the default) are worth
    "engine_adamw_per_tensor": VariantSpec(
        "engine", "engine, Triton AdamW with one launch per tensor (no multi-tensor launches)", adamw_multi_numel=0
    ),
    "engine_in_backward_ac": VariantSpec(
        "engine",
        "engine, updates inside the backward and activation checkpointing per layer (the least memory)",
        optimizer_in_backward=True,
        activation_checkpointing=True,
    ),
    # 8-bit AdamW moments (train.optimizer_states): the anchor's optimizer keeps bf16 ones, so these rows change
    # the optimizer's storage, and say so in their names
    "engine_adamw8": VariantSpec(
        "engine", "engine, AdamW moments in 8 bits (blockwise scales, stochastic rounding)", optimizer_states="8bit"
    ),
    "engine_in_backward_adamw8": VariantSpec(
        "engine",
        "engine, updates inside the backward with 8-bit AdamW moments (no clipping)",
        optimizer_in_backward=True,
        optimizer_states="8bit",
    ),
    "engine_cuda_graphs": VariantSpec(
        "engine",
        "engine, the decoder stack replayed as CUDA graphs (train.cuda_graphs)",
        cuda_graphs=True,
        needs_cuda=True,
        cuda_reason="CUDA graphs need a CUDA GPU",
    ),
    "engine_fp32_master": VariantSpec(
        "engine", "engine, float32 master weights and moments, bf16 compute", precision="fp32_master"
    ),
}
# the fair rows beside the anchor: v5 + Liger, both gates, torch's AdamW (anchor_cudnn measured equal to the anchor:
# 38,523 vs 38,568)
DEFAULT_VARIANTS = ("anchor", "anchor_liger", "engine", "engine_balanced", "engine_adamw_torch")


def default_out_dir() -> str:
    """`<runs directory>/bench`: results land with the runs, not in whatever folder is current."""
    return str(default_runs_dir() / "bench")


def _check_int(value: Any, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"BenchConfig.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark launch: model, shapes, steps, mesh and engine backends, which variants."""

    preset: str = "tiny"
    layers: int | None = None  # None = the preset's depth
    seq: int = 128
    batch: int = 2  # local batch: sequences per rank per micro-batch
    # micro-batches per optimizer step (train.global_batch_size = batch x ranks x this): the AdamW pass over every
    # weight is paid once per step, as a multi-GPU run shares it among its ranks
    accumulation: int = 1
    warmup: int = 2  # trainer steps run but not timed, in every round (each round builds the variant afresh)
    steps: int = 30  # timed steps of each variant, split over the rounds
    # variants run in order, then reversed, ... (ABC CBA ...): drift hits every variant alike; None = 2 (1 for one step)
    rounds: int | None = None
    lr: float = 3e-4
    seed: int = 0
    variants: tuple[str, ...] = DEFAULT_VARIANTS
    mesh: Any = None  # workbench.MeshConfig; None = dp = world, ep = world when it divides the experts
    backend: BackendConfig = field(default_factory=BackendConfig)  # the engine's; gate set per variant
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    precision: str = "auto"  # the engine's train.precision where its variant sets none (the anchor: torch AdamW, bf16)
    out_dir: str | None = field(default_factory=default_out_dir)  # None: write nothing
    name: str | None = None  # results file stem; None = <date>-<device>
    command: str | None = None  # recorded in the JSON; None = this process's argv
    html: bool = True
    fail_fast: bool = False  # re-raise a failing variant instead of recording it

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ConfigError(f"unknown model preset {self.preset!r}; presets: {sorted(PRESETS)}")
        if self.layers is not None:
            _check_int(self.layers, "layers", 1)
        _check_int(self.seq, "seq", 2)
        _check_int(self.batch, "batch", 1)
        _check_int(self.accumulation, "accumulation", 1)
        _check_int(self.warmup, "warmup", 0)
        _check_int(self.steps, "steps", 1)
        if self.rounds is None:
            object.__setattr__(self, "rounds", min(2, self.steps))
        _check_int(self.rounds, "rounds", 1)
        if self.rounds > self.steps:
            raise ConfigError(
                f"BenchConfig.rounds ({self.rounds}) exceeds steps ({self.steps}): every round needs a "
                "timed step; lower rounds or raise steps"
            )
        _check_int(self.seed, "seed", 0)
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or not 0 < self.lr < math.inf:
            raise ConfigError(f"BenchConfig.lr must be a positive number (and finite), got {self.lr!r}")
        variants = self.variants.split(",") if isinstance(self.variants, str) else list(self.variants)
        variants = [v.strip() for v in variants if v.strip()]
        unknown = [v for v in variants if v not in VARIANTS]
        if unknown or not variants:
            raise ConfigError(f"unknown bench variant(s) {unknown or variants}; choose from {list(VARIANTS)}")
        if len(set(variants)) != len(variants):
            raise ConfigError(f"bench variants repeat a name: {variants}")
        object.__setattr__(self, "variants", tuple(variants))
        if self.mesh is not None and not hasattr(self.mesh, "validate"):
            raise ConfigError(f"bench mesh must be a workbench MeshConfig or None, got {self.mesh!r}")
        if not isinstance(self.backend, BackendConfig):
            raise ConfigError(f"bench backend must be a workbench.BackendConfig, got {type(self.backend).__name__}")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ConfigError(f"bench dtype must be auto, float32 or bfloat16, got {self.dtype!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"bench precision must be one of {PRECISIONS}, got {self.precision!r}")
        if isinstance(self.out_dir, os.PathLike):
            object.__setattr__(self, "out_dir", os.fspath(self.out_dir))
        if self.out_dir is not None and (not isinstance(self.out_dir, str) or not self.out_dir):
            raise ConfigError(
                f"BenchConfig.out_dir must be a directory path, or None to write nothing; got {self.out_dir!r}"
            )
        if self.name is not None and (not isinstance(self.name, str) or not self.name or "/" in self.name):
            raise ConfigError(f"bench name must be a plain file stem, got {self.name!r}")

    def hf_config(self):
        """The Transformers config of the benchmarked model."""
        return preset_config(self.preset, self.layers)

    def to_dict(self) -> dict[str, Any]:
        """JSON-able mapping (mesh and backend as plain mappings)."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["variants"] = list(self.variants)
        data["mesh"] = self.mesh.to_dict() if self.mesh is not None else None
        data["backend"] = self.backend.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BenchConfig:
        """Inverse of to_dict; unknown keys are an error."""
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ConfigError(f"unknown BenchConfig key(s) {unknown}; allowed: {sorted(allowed)}")
        kwargs = dict(data)
        if isinstance(kwargs.get("mesh"), dict):
            kwargs["mesh"] = MeshConfig(**kwargs["mesh"])
        if isinstance(kwargs.get("backend"), dict):
            kwargs["backend"] = BackendConfig.from_dict(kwargs["backend"])
        if "variants" in kwargs and isinstance(kwargs["variants"], list):
            kwargs["variants"] = tuple(kwargs["variants"])
        return cls(**kwargs)
