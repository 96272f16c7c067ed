"""RunConfig: everything one fine-tuning run needs, as frozen, validated dataclasses.

The same object travels from the notebook widgets to every rank (as a dict) and to disk (YAML
or config.json), so every section refuses unknown keys and checks its values at construction.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.backends import BackendConfig
from workbench.presets import PRESETS, TINY_VOCAB_SIZE, build_preset_config  # noqa: F401 (re-exported)

DATA_DIR = Path(__file__).resolve().parent / "data"
TINY_SFT_PATH = DATA_DIR / "tiny_sft.jsonl"
TOKENIZER_DIR = DATA_DIR / "tokenizer"

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
DATA_KINDS = ("synthetic", "jsonl", "datasets")
# How a `datasets` row becomes tokens (workbench/train/data_rows.py): "auto" picks by the columns present.
ROW_FORMATS = ("auto", "messages", "prompt_completion", "instruction", "text")
# The row fields each format reads; data.columns maps them to the dataset's own column names.
ROW_FIELDS = {"messages": ("messages",), "prompt_completion": ("prompt", "completion"),
              "instruction": ("instruction", "input", "output"), "text": ("text",)}
# Local files `datasets` reads by builder name, from the file's extension.
DATA_FILE_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".json": "json", ".jsonl": "json", ".csv": "csv"}
# "adamw": Triton AdamW on CUDA (torch's fused math, more bandwidth), torch AdamW elsewhere;
# "adamw_torch": always torch.optim.AdamW (fused on CUDA); "adamw_triton": always TritonAdamW
OPTIMIZERS = ("adamw", "adamw_torch", "adamw_triton")
# How a bf16 model's weights are updated (workbench.train.precision); on float32 weights every one is plain float32.
PRECISIONS = ("auto", "bf16", "bf16_sr", "fp32_master")


class ConfigError(ValueError):
    """A RunConfig (or one of its sections) that cannot describe a valid run."""


def _check_keys(cls: type, data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__} {data!r}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; allowed keys: {allowed}")


def _check_int(value: Any, name: str, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_float(value: Any, name: str, lo: float, hi: float | None = None) -> None:
    # math.isfinite first: nan compares False with every bound, so `value < lo` alone lets it through
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or value < lo or (hi is not None and value > hi)):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")


# ---------------------------------------------------------------------------------------------
# Model presets (workbench/presets.py holds them)


def preset_config(name: str, layers: int | None = None):
    """The family's transformers config (Qwen3MoeConfig, GptOssConfig, ...) for a preset name.

    `layers` overrides the number of decoder layers (random init: presets have no weights).
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
    _check_int(layers, "layers", 1, allow_none=True)
    return build_preset_config(name, layers)


# ---------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class ModelConfig:
    """Which model: a preset name (random init) or a local HF checkpoint directory."""

    preset: str | None = "tiny"
    path: str | None = None
    layers: int | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"  # one of DEVICES; auto: this rank's CUDA device, else the CPU
    router_aux_loss_coef: float | None = None  # None = the preset's / checkpoint's value

    def __post_init__(self) -> None:
        if (self.preset is None) == (self.path is None):
            raise ConfigError(f"model needs exactly one of preset= or path=, got preset={self.preset!r}, "
                              f"path={self.path!r}")
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"unknown model preset {self.preset!r}; presets: {sorted(PRESETS)}")
        if self.path is not None and not isinstance(self.path, str):
            raise ConfigError(f"model.path must be a string, got {self.path!r}")
        _check_int(self.layers, "model.layers", 1, allow_none=True)
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"model.device {self.device!r} is not one of {list(DEVICES)}")
        if self.router_aux_loss_coef is not None:
            _check_float(self.router_aux_loss_coef, "model.router_aux_loss_coef", 0.0)

    def hf_config(self):
        """The transformers config of this model (reads config.json for a local path)."""
        if self.preset is not None:
            cfg = preset_config(self.preset, self.layers)
        else:
            from workbench.config_io import read_hf_config

            cfg = read_hf_config(Path(self.path).expanduser())
            if self.layers is not None:
                types = getattr(cfg, "layer_types", None)
                if types and len(types) < self.layers:
                    raise ConfigError(f"model.layers ({self.layers}) exceeds the {len(types)} layers of {self.path} "
                                      f"(its config.json lists layer_types per layer); use {len(types)} or fewer")
                cfg.num_hidden_layers = self.layers
                if types:  # GPT-OSS's sliding/full pattern is per layer: keep the first `layers`
                    cfg.layer_types = list(types[:self.layers])
        if self.router_aux_loss_coef is not None:
            cfg.router_aux_loss_coef = float(self.router_aux_loss_coef)
        return cfg


@dataclass(frozen=True)
class DataConfig:
    """Where tokens come from: synthetic tokens, a local JSONL SFT file, or a `datasets` dataset."""

    kind: str = "jsonl"
    # jsonl: the file (None = the shipped tiny dataset); datasets: a save_to_disk folder or a dataset name
    path: str | None = None
    tokenizer: str | None = None  # tokenizer directory; None = model.path's when it has one, else the shipped one
    seq_len: int = 128
    pack: bool = True
    max_length: int | None = None  # longest allowed example in tokens; None = seq_len
    # kind="datasets" only:
    data_files: Any = None  # local parquet/arrow/json/jsonl/csv file(s): a path or a list of paths
    split: str = "train"
    format: str = "auto"  # one of ROW_FORMATS
    columns: Any = None  # {row field: dataset column}, e.g. {"prompt": "question", "completion": "answer"}
    assistant_only_loss: bool = True  # chat rows: loss on assistant tokens only (False: on every token)
    cache_dir: str | None = None  # tokenized cache; None = <runs directory>/.cache/tokenized
    eval_fraction: float = 0.0  # share of the rows held out for eval (a seeded choice)
    eval_files: Any = None  # eval rows from their own local file(s) instead
    eval_every: int = 0  # evaluate every N optimizer steps (and after the last); 0 = never

    def __post_init__(self) -> None:
        if self.kind not in DATA_KINDS:
            raise ConfigError(f"data.kind {self.kind!r} is not one of {list(DATA_KINDS)}")
        _check_int(self.seq_len, "data.seq_len", 2)
        _check_int(self.max_length, "data.max_length", 2, allow_none=True)
        if self.max_length is not None and self.max_length > self.seq_len:
            raise ConfigError(f"data.max_length ({self.max_length}) cannot exceed data.seq_len ({self.seq_len})")
        if not isinstance(self.pack, bool):
            raise ConfigError(f"data.pack must be true or false, got {self.pack!r}")
        if self.kind == "synthetic" and self.path is not None:
            raise ConfigError("data.path is only used with kind='jsonl' or 'datasets'; drop it for synthetic data")
        for name in ("path", "tokenizer", "cache_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"data.{name} must be a non-empty string, got {value!r}")
        if self.kind != "datasets":
            extra = [f"data.{f.name}" for f in dataclasses.fields(self)
                     if f.name in _DATASETS_ONLY and getattr(self, f.name) != f.default]
            if extra:
                raise ConfigError(f"{', '.join(extra)} only apply to data.kind='datasets' (this is {self.kind!r})")
            return
        self._check_datasets()

    def _check_datasets(self) -> None:
        if (self.path is None) == (self.data_files is None):
            raise ConfigError("data.kind='datasets' needs exactly one of data.data_files (local parquet/arrow/json/"
                              "jsonl/csv files) or data.path (a save_to_disk folder or a dataset name), got "
                              f"data_files={self.data_files!r}, path={self.path!r}")
        _check_files(self.data_files, "data.data_files")
        _check_files(self.eval_files, "data.eval_files")
        if not isinstance(self.split, str) or not self.split:
            raise ConfigError(f"data.split must be a split name such as 'train', got {self.split!r}")
        if self.format not in ROW_FORMATS:
            raise ConfigError(f"data.format {self.format!r} is not one of {list(ROW_FORMATS)}")
        if self.columns is not None:
            fields = sorted({f for fs in ROW_FIELDS.values() for f in fs})
            if not isinstance(self.columns, dict) or not all(isinstance(v, str) for v in self.columns.values()):
                raise ConfigError(f"data.columns must map row fields to column names, e.g. "
                                  f"{{'prompt': 'question'}}, got {self.columns!r}")
            unknown = [k for k in self.columns if k not in fields]
            if unknown:
                raise ConfigError(f"data.columns has unknown row field(s) {unknown}; row fields: {fields}")
        if not isinstance(self.assistant_only_loss, bool):
            raise ConfigError(f"data.assistant_only_loss must be true or false, got {self.assistant_only_loss!r}")
        _check_float(self.eval_fraction, "data.eval_fraction", 0.0, 0.5)
        if self.eval_fraction and self.eval_files is not None:
            raise ConfigError("set one of data.eval_fraction or data.eval_files, not both")
        _check_int(self.eval_every, "data.eval_every", 0)
        if self.eval_every and not (self.eval_fraction or self.eval_files):
            raise ConfigError("data.eval_every needs eval rows: set data.eval_fraction (e.g. 0.1) or data.eval_files")

    def check_fits(self, hf_config: Any) -> None:
        """Refuse a seq_len longer than the model's max_position_embeddings (before any allocation)."""
        limit = getattr(hf_config, "max_position_embeddings", None)
        if isinstance(limit, int) and self.seq_len > limit:
            raise ConfigError(f"data.seq_len ({self.seq_len}) exceeds the model's max_position_embeddings "
                              f"({limit}); set data.seq_len to {limit} or less")

    @property
    def resolved_path(self) -> Path:
        return Path(self.path).expanduser() if self.path else TINY_SFT_PATH

    @property
    def resolved_tokenizer(self) -> Path:
        return Path(self.tokenizer).expanduser() if self.tokenizer else TOKENIZER_DIR

    @property
    def example_max_length(self) -> int:
        return self.max_length or self.seq_len


_DATASETS_ONLY = ("data_files", "split", "format", "columns", "assistant_only_loss", "cache_dir", "eval_fraction",
                  "eval_files", "eval_every")


def _check_files(value: Any, name: str) -> None:
    if value is None:
        return
    files = [value] if isinstance(value, str) else value
    if not isinstance(files, (list, tuple)) or not files or not all(isinstance(f, str) and f for f in files):
        raise ConfigError(f"{name} must be a file path or a non-empty list of paths, got {value!r}")
    for f in files:
        suffix = Path(f).suffix.lower()
        if suffix not in DATA_FILE_BUILDERS:
            raise ConfigError(f"{name}: {f!r} is not one of the file types {sorted(DATA_FILE_BUILDERS)}; "
                              "a save_to_disk folder goes in data.path")


# Settings a resume must keep unless train.resume_allow_changes names them: the LR schedule, the
# optimizer's update and the data position in the checkpoint depend on them. train.optimizer is
# not one: torch's and the Triton AdamW share their state and may be swapped on resume.
RESUME_FIELDS = ("train.steps", "train.warmup_steps", "train.lr", "train.min_lr_ratio", "train.global_batch_size",
                 "train.weight_decay", "train.betas", "train.precision",
                 "data.kind", "data.path", "data.tokenizer", "data.seq_len", "data.pack", "data.max_length",
                 "data.data_files", "data.split", "data.format", "data.columns", "data.assistant_only_loss",
                 "data.eval_fraction", "data.eval_files", "lora.rank", "lora.alpha", "lora.dropout", "lora.targets")


@dataclass(frozen=True)
class TrainConfig:
    """Optimization and bookkeeping: steps, batch sizes, AdamW, schedule, checkpoints."""

    steps: int = 20
    global_batch_size: int = 8  # sequences per optimizer step, over all data-parallel ranks
    local_batch_size: int = 4  # sequences per forward on one rank
    grad_accum: int | None = None  # None = global / (local * dp); if set it must agree
    lr: float = 3e-3
    warmup_steps: int = 2
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    clip_grad_norm: float | None = 1.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    optimizer: str = "adamw"  # one of OPTIMIZERS
    # one of PRECISIONS: "bf16" rounds each update to nearest (loses most at lr 1e-5), "bf16_sr" rounds
    # it stochastically, "fp32_master" keeps float32 weights in the optimizer; "auto" = bf16_sr
    precision: str = "auto"
    seed: int = 0
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (train/activation_checkpoint.py)
    # Aux-loss-free balancing (DeepSeek-V3): after each step, bias_e += rate * sign(mean load - load_e); 0 = off.
    router_bias_update_rate: float = 0.0
    checkpoint_every: int | None = None  # steps; None = only at the end
    save_final_checkpoint: bool = True
    export_hf: bool = False  # write a vanilla HF checkpoint (save_pretrained) at the end
    log_every: int = 1  # print to stdout every N steps (metrics are recorded every step)
    resume_from: str | None = None  # a checkpoint directory, or a run directory (latest checkpoint)
    resume_allow_changes: tuple[str, ...] = ()  # RESUME_FIELDS this run may change from the checkpoint's

    def __post_init__(self) -> None:
        _check_int(self.steps, "train.steps", 1)
        _check_int(self.global_batch_size, "train.global_batch_size", 1)
        _check_int(self.local_batch_size, "train.local_batch_size", 1)
        _check_int(self.grad_accum, "train.grad_accum", 1, allow_none=True)
        if self.global_batch_size % self.local_batch_size:
            raise ConfigError(f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                              f"train.local_batch_size ({self.local_batch_size})")
        _check_float(self.lr, "train.lr", 0.0)
        _check_int(self.warmup_steps, "train.warmup_steps", 0)
        _check_float(self.min_lr_ratio, "train.min_lr_ratio", 0.0, 1.0)
        if self.clip_grad_norm is not None:
            _check_float(self.clip_grad_norm, "train.clip_grad_norm", 0.0)
            if self.clip_grad_norm == 0:  # clipping to norm 0 zeroes every update: the run would not train
                raise ConfigError("train.clip_grad_norm must be > 0 (0 zeroes every update); "
                                  "use null (None) to turn clipping off")
        _check_float(self.weight_decay, "train.weight_decay", 0.0)
        if (not isinstance(self.betas, (tuple, list)) or len(self.betas) != 2
                or not all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.betas)):
            raise ConfigError(f"train.betas must be two finite numbers in [0, 1), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(float(b) for b in self.betas))
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"train.optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.optimizer == "adamw_torch" and self.precision in ("bf16_sr", "fp32_master"):
            raise ConfigError(f"train.precision={self.precision!r} needs the workbench AdamW: set train.optimizer "
                              "to 'adamw' (or 'adamw_triton'), or train.precision to 'bf16'")
        _check_int(self.seed, "train.seed", 0)
        _check_float(self.router_bias_update_rate, "train.router_bias_update_rate", 0.0)
        _check_int(self.checkpoint_every, "train.checkpoint_every", 1, allow_none=True)
        _check_int(self.log_every, "train.log_every", 1)
        allowed = self.resume_allow_changes
        if (not isinstance(allowed, (tuple, list)) or not all(isinstance(n, str) for n in allowed)
                or set(allowed) - set(RESUME_FIELDS)):
            raise ConfigError(f"train.resume_allow_changes must be a list of names from {list(RESUME_FIELDS)}, "
                              f"got {allowed!r}")
        if "train.precision" in allowed:
            # fp32_master keeps float32 master weights in the optimizer state and the others do not: the
            # checkpoint's optimizer state cannot be read as another mode's.
            raise ConfigError("train.precision cannot change on resume (its optimizer state differs between modes); "
                              "keep the checkpoint's precision, or start a new run from the exported model "
                              "(train.export_hf) with another one")
        object.__setattr__(self, "resume_allow_changes", tuple(allowed))
        for name in ("activation_checkpointing", "save_final_checkpoint", "export_hf"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"train.{name} must be true or false, got {getattr(self, name)!r}")

    def accumulation_steps(self, dp: int) -> int:
        """Micro-batches per rank per optimizer step for a data-parallel size `dp`."""
        per_rank, rem = divmod(self.global_batch_size, dp)
        if rem or per_rank % self.local_batch_size:
            raise ConfigError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"local_batch_size ({self.local_batch_size}) x data-parallel size ({dp})")
        accum = per_rank // self.local_batch_size
        if self.grad_accum is not None and self.grad_accum != accum:
            raise ConfigError(f"train.grad_accum={self.grad_accum} disagrees with global_batch_size / "
                              f"(local_batch_size x dp) = {accum}; drop grad_accum or fix the batch sizes")
        return accum


# What LoRA can adapt (workbench/models/lora_targets.py finds each in a model): the attention projections
# (MLA's too), the routed experts' fused gate/up and down weights, shared experts, the MLPs of dense
# layers, and the router's gate where it is an nn.Linear.
LORA_TARGETS = ("attention", "experts", "shared_experts", "dense_mlp", "router")


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
        _check_int(self.rank, "lora.rank", 1)
        _check_float(self.alpha, "lora.alpha", 0.0)
        if self.alpha == 0:
            raise ConfigError("lora.alpha must be > 0 (0 scales every adapter to nothing); the usual is 2 x rank")
        _check_float(self.dropout, "lora.dropout", 0.0, 1.0)
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


def _lora_from_dict(data: Any):
    if data is None or isinstance(data, LoraConfig):
        return data
    _check_keys(LoraConfig, data, "lora")
    return LoraConfig(**data)


def _mesh_from_dict(data: Any):
    if data is None:
        return None
    from workbench.parallel.mesh import MeshConfig

    if isinstance(data, MeshConfig):
        return data
    _check_keys(MeshConfig, data, "mesh")
    return MeshConfig(**data)


@dataclass(frozen=True)
class RunConfig:
    """One fine-tuning run: model, mesh, backends, data, training and where to write it."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: Any = None  # workbench.parallel.mesh.MeshConfig; None = dp = world, ep = world (if it divides E)
    backend: BackendConfig = field(default_factory=BackendConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    lora: LoraConfig | None = None  # None = full fine-tuning
    output_dir: str | None = None  # runs directory; None = workbench.train.run_dir.default_runs_dir()
    run_id: str | None = None
    name: str | None = None  # a label for the run in the lab sidebar and comparisons (run_id stays the folder)

    def __post_init__(self) -> None:
        for name, cls in (("model", ModelConfig), ("backend", BackendConfig), ("data", DataConfig),
                          ("train", TrainConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"RunConfig.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ConfigError(f"RunConfig.lora must be a LoraConfig or None, got {type(self.lora).__name__}")
        if self.mesh is not None and not hasattr(self.mesh, "validate"):
            raise ConfigError(f"RunConfig.mesh must be a MeshConfig or None, got {self.mesh!r}")
        if self.output_dir is not None and not isinstance(self.output_dir, (str, os.PathLike)):
            raise ConfigError(f"output_dir must be a path string, got {self.output_dir!r}")
        if self.output_dir is not None:
            object.__setattr__(self, "output_dir", str(self.output_dir))
        if self.run_id is not None and (not isinstance(self.run_id, str) or not self.run_id
                                        or "/" in self.run_id or self.run_id in (".", "..")):
            raise ConfigError(f"run_id must be a plain directory name, got {self.run_id!r}")
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()
                                      or len(self.name) > 200):
            raise ConfigError(f"name must be a non-empty string of at most 200 characters, got {self.name!r}")

    # -- conversions --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-able mapping (inverse of from_dict)."""
        mesh = None
        if self.mesh is not None:
            mesh = self.mesh.to_dict() if hasattr(self.mesh, "to_dict") else dataclasses.asdict(self.mesh)
        train = dataclasses.asdict(self.train)
        train["betas"] = list(train["betas"])
        return {"model": dataclasses.asdict(self.model), "mesh": mesh, "backend": self.backend.to_dict(),
                "data": dataclasses.asdict(self.data), "train": train,
                "lora": None if self.lora is None else self.lora.to_dict(),
                "output_dir": self.output_dir, "run_id": self.run_id, "name": self.name}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "RunConfig":
        """Build from a mapping; unknown keys at any level are an error naming the key."""
        _check_keys(cls, data, "RunConfig")
        kwargs: dict[str, Any] = {}
        for name, section in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
            if data.get(name) is not None:
                _check_keys(section, data[name], name)
                kwargs[name] = section(**data[name])
        if data.get("backend") is not None:
            _check_keys(BackendConfig, data["backend"], "backend")
            kwargs["backend"] = BackendConfig(**data["backend"])
        kwargs["mesh"] = _mesh_from_dict(data.get("mesh"))
        kwargs["lora"] = _lora_from_dict(data.get("lora"))
        for key in ("output_dir", "run_id", "name"):
            if key in data:
                kwargs[key] = data[key]
        return cls(**kwargs)

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """YAML text of this config; also written to `path` if given."""
        from workbench.config_io import dump_yaml

        text = dump_yaml(self.to_dict())
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_yaml(cls, path_or_text: str | os.PathLike) -> "RunConfig":
        """Load from a YAML file path (or YAML text containing a newline)."""
        import yaml

        from workbench.config_io import load_yaml

        text = str(path_or_text)
        source = "YAML text"
        if "\n" not in text:
            p = Path(text).expanduser()
            if not p.is_file():
                raise ConfigError(f"config file {p} does not exist")
            text, source = p.read_text(encoding="utf-8"), str(p)
        try:
            data = load_yaml(text) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{source} is not valid YAML: {err}") from err
        try:
            return cls.from_dict(data)
        except ConfigError as err:
            raise ConfigError(f"{source}: {err}") from err

    def replace(self, **changes: Any) -> "RunConfig":
        """A copy with top-level fields replaced."""
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: dict[str, Any]) -> "RunConfig":
        """A copy with dotted-key overrides applied, e.g. {"train.steps": 5, "data.seq_len": 64}."""
        data = self.to_dict()
        for dotted, value in overrides.items():
            parts = dotted.split(".")
            target = data
            for part in parts[:-1]:
                if not isinstance(target.get(part), dict):
                    target[part] = {} if target.get(part) is None else target[part]
                target = target[part]
            target[parts[-1]] = value
        return RunConfig.from_dict(data)

    @classmethod
    def demo(cls, **overrides: Any) -> "RunConfig":
        """The embedded default: tiny Qwen3-MoE, the shipped SFT data, EP = world size.

        Keyword overrides are dotted keys with "." written as "__" (train__steps=5) or whole
        sections (train=TrainConfig(...)).
        """
        base = cls(
            model=ModelConfig(preset="tiny", dtype="auto"),
            mesh=None,
            backend=BackendConfig(),
            data=DataConfig(kind="jsonl", seq_len=128, pack=True),
            train=TrainConfig(steps=20, global_batch_size=8, local_batch_size=4, lr=3e-3,
                              warmup_steps=2, checkpoint_every=None, export_hf=False),
        )
        sections = {k: v for k, v in overrides.items() if "__" not in k}
        dotted = {k.replace("__", "."): v for k, v in overrides.items() if "__" in k}
        if sections:
            base = dataclasses.replace(base, **sections)
        return base.with_overrides(dotted) if dotted else base
