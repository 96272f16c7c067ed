"""RunConfig: everything one fine-tuning run needs, as frozen, validated dataclasses.

The same object travels from the notebook widgets to every rank (as a dict) and to disk (YAML
or config.json), so every section refuses unknown keys and checks its values at construction.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from workbench.backends import BackendConfig

# The sections live in their own modules; every public name stays importable from here.
from workbench.config_checks import ConfigError, check_float, check_int, check_keys
from workbench.config_data import (
    DATA_DIR,
    DATA_FILE_BUILDERS,
    DATA_KINDS,
    ROW_FIELDS,
    ROW_FORMATS,
    TINY_SFT_PATH,
    TOKENIZER_DIR,
    DataConfig,
)
from workbench.config_io import dump_yaml, load_yaml, read_hf_config
from workbench.config_lora import LORA_TARGETS, LoraConfig, lora_from_dict
from workbench.config_train import FIXED_ON_RESUME, OPTIMIZER_STATES, OPTIMIZERS, PRECISIONS, RESUME_FIELDS, TrainConfig
from workbench.parallel.mesh import MeshConfig
from workbench.presets import PRESETS, TINY_VOCAB_SIZE, build_preset_config
from workbench.runs.run_names import RUN_NAME_MAX_CHARS, run_id_problem, shown_id

__all__ = [
    "DATA_DIR",
    "DATA_FILE_BUILDERS",
    "DATA_KINDS",
    "DEVICES",
    "DTYPES",
    "FIXED_ON_RESUME",
    "LORA_TARGETS",
    "OPTIMIZERS",
    "OPTIMIZER_STATES",
    "PRECISIONS",
    "PRESETS",
    "RESUME_FIELDS",
    "ROW_FIELDS",
    "ROW_FORMATS",
    "TINY_SFT_PATH",
    "TINY_VOCAB_SIZE",
    "TOKENIZER_DIR",
    "ConfigError",
    "DataConfig",
    "LoraConfig",
    "ModelConfig",
    "RunConfig",
    "TrainConfig",
    "preset_config",
]

DTYPES = ("auto", "float32", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")


# ---------------------------------------------------------------------------------------------
# Model presets (workbench/presets.py holds them)


def preset_config(name: str, layers: int | None = None):
    """The family's transformers config (Qwen3MoeConfig, GptOssConfig, ...) for a preset name.

    `layers` overrides the number of decoder layers (random init: presets have no weights).
    """
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; presets: {sorted(PRESETS)}")
    check_int(layers, "layers", 1, allow_none=True)
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
            raise ConfigError(
                f"model needs exactly one of preset= or path=, got preset={self.preset!r}, path={self.path!r}"
            )
        if self.preset is not None and self.preset not in PRESETS:
            raise ConfigError(f"unknown model preset {self.preset!r}; presets: {sorted(PRESETS)}")
        if self.path is not None and not isinstance(self.path, str):
            raise ConfigError(f"model.path must be a string, got {self.path!r}")
        check_int(self.layers, "model.layers", 1, allow_none=True)
        if self.dtype not in DTYPES:
            raise ConfigError(f"model.dtype {self.dtype!r} is not one of {list(DTYPES)}")
        if self.device not in DEVICES:
            raise ConfigError(f"model.device {self.device!r} is not one of {list(DEVICES)}")
        if self.router_aux_loss_coef is not None:
            check_float(self.router_aux_loss_coef, "model.router_aux_loss_coef", 0.0)

    def hf_config(self):
        """The transformers config of this model (reads config.json for a local path)."""
        if self.preset is not None:
            cfg = preset_config(self.preset, self.layers)
        else:
            cfg = read_hf_config(Path(self.path).expanduser())
            if self.layers is not None:
                types = getattr(cfg, "layer_types", None)
                if types and len(types) < self.layers:
                    raise ConfigError(
                        f"model.layers ({self.layers}) exceeds the {len(types)} layers of {self.path} "
                        f"(its config.json lists layer_types per layer); use {len(types)} or fewer"
                    )
                cfg.num_hidden_layers = self.layers
                if types:  # GPT-OSS's sliding/full pattern is per layer: keep the first `layers`
                    cfg.layer_types = list(types[: self.layers])
        if self.router_aux_loss_coef is not None:
            cfg.router_aux_loss_coef = float(self.router_aux_loss_coef)
        return cfg


def _mesh_from_dict(data: Any):
    if data is None:
        return None
    if isinstance(data, MeshConfig):
        return data
    check_keys(MeshConfig, data, "mesh")
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
    output_dir: str | None = None  # runs directory; None = workbench.runs.run_dir.default_runs_dir()
    run_id: str | None = None
    name: str | None = None  # a label for the run in the lab sidebar and comparisons (run_id stays the folder)

    def __post_init__(self) -> None:
        for name, cls in (
            ("model", ModelConfig),
            ("backend", BackendConfig),
            ("data", DataConfig),
            ("train", TrainConfig),
        ):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(
                    f"RunConfig.{name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}"
                )
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ConfigError(f"RunConfig.lora must be a LoraConfig or None, got {type(self.lora).__name__}")
        if self.mesh is not None and not hasattr(self.mesh, "validate"):
            raise ConfigError(f"RunConfig.mesh must be a MeshConfig or None, got {self.mesh!r}")
        if self.output_dir is not None and not isinstance(self.output_dir, (str, os.PathLike)):
            raise ConfigError(f"output_dir must be a path string, got {self.output_dir!r}")
        if self.output_dir is not None:
            object.__setattr__(self, "output_dir", str(self.output_dir))
        if self.run_id is not None and (problem := run_id_problem(self.run_id)):
            raise ConfigError(problem)
        if self.name is not None and (
            not isinstance(self.name, str) or not self.name.strip() or len(self.name) > RUN_NAME_MAX_CHARS
        ):
            raise ConfigError(
                f"name must be a non-empty string of at most {RUN_NAME_MAX_CHARS} characters, got {shown_id(self.name)}"
            )

    # -- conversions --------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON/YAML-able mapping (inverse of from_dict)."""
        mesh = None
        if self.mesh is not None:
            mesh = self.mesh.to_dict() if hasattr(self.mesh, "to_dict") else dataclasses.asdict(self.mesh)
        train = dataclasses.asdict(self.train)
        train["betas"] = list(train["betas"])
        return {
            "model": dataclasses.asdict(self.model),
            "mesh": mesh,
            "backend": self.backend.to_dict(),
            "data": dataclasses.asdict(self.data),
            "train": train,
            "lora": None if self.lora is None else self.lora.to_dict(),
            "output_dir": self.output_dir,
            "run_id": self.run_id,
            "name": self.name,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        """Build from a mapping; unknown keys at any level are an error naming the key."""
        check_keys(cls, data, "RunConfig")
        kwargs: dict[str, Any] = {}
        for name, section in (("model", ModelConfig), ("data", DataConfig), ("train", TrainConfig)):
            if data.get(name) is not None:
                check_keys(section, data[name], name)
                kwargs[name] = section(**data[name])
        if data.get("backend") is not None:
            check_keys(BackendConfig, data["backend"], "backend")
            kwargs["backend"] = BackendConfig(**data["backend"])
        kwargs["mesh"] = _mesh_from_dict(data.get("mesh"))
        kwargs["lora"] = lora_from_dict(data.get("lora"))
        for key in ("output_dir", "run_id", "name"):
            if key in data:
                kwargs[key] = data[key]
        return cls(**kwargs)

    def to_yaml(self, path: str | os.PathLike | None = None) -> str:
        """YAML text of this config; also written to `path` if given."""
        text = dump_yaml(self.to_dict())
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @classmethod
    def from_yaml(cls, path_or_text: str | os.PathLike) -> RunConfig:
        """Load from a YAML file path (or YAML text containing a newline)."""
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

    def replace(self, **changes: Any) -> RunConfig:
        """A copy with top-level fields replaced."""
        return dataclasses.replace(self, **changes)

    def with_overrides(self, overrides: dict[str, Any]) -> RunConfig:
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
    def demo(cls, **overrides: Any) -> RunConfig:
        """The embedded default: tiny Qwen3-MoE, the shipped SFT data, EP = world size.

        Keyword overrides are dotted keys with "." written as "__" (train__steps=5) or whole
        sections (train=TrainConfig(...)).
        """
        base = cls(
            model=ModelConfig(preset="tiny", dtype="auto"),
            mesh=None,
            backend=BackendConfig(),
            data=DataConfig(kind="jsonl", seq_len=128, pack=True),
            train=TrainConfig(
                steps=20,
                global_batch_size=8,
                local_batch_size=4,
                lr=3e-3,
                warmup_steps=2,
                checkpoint_every=None,
                export_hf=False,
            ),
        )
        sections = {k: v for k, v in overrides.items() if "__" not in k}
        dotted = {k.replace("__", "."): v for k, v in overrides.items() if "__" in k}
        if sections:
            base = dataclasses.replace(base, **sections)
        return base.with_overrides(dotted) if dotted else base
