"""A run's latest weights in Transformers' own model class on one device, with the tokenizer the run trained with.

Generation runs in Transformers' class for the model type, the class `train.export_hf` writes: from the
run's hf/ export as Transformers reads it (safetensors only, no remote code), or from its latest step-*
checkpoint as the export would have written it. A checkpoint is read the way a resume reads it
(manifest, allow-listed DCP metadata, a LoRA run's base checked against the one it recorded) into the
engine's model built from the run's config on this one process; its weights then move into Transformers'
class, a LoRA run's adapters folded in (workbench.models.lora_export.merged_state_dict), as the export does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn

from workbench.backends import BackendConfig
from workbench.config import RunConfig
from workbench.config_checks import ConfigError
from workbench.config_io import read_hf_config
from workbench.generation.run_weights import EXPORT, RunWeights
from workbench.models.engine_state import engine_state
from workbench.models.full_state import full_state_dict
from workbench.models.lora_export import merged_state_dict
from workbench.models.meta_model import meta_model
from workbench.models.sliced_load import init_nonpersistent_buffers
from workbench.parallel import dist_utils as du
from workbench.runs.run_dir import RunDir
from workbench.train.checkpoint_checks import check_compatible, verify_checkpoint
from workbench.train.checkpoint_load import load_model_weights
from workbench.train.data_tokenizer import check_vocab, load_tokenizer, resolve_tokenizer_dir
from workbench.train.lora_base import base_record, check_base_description, check_base_weights, describe_base, saved_base
from workbench.train.model_setup import build_model, model_dtype

DEVICES = ("auto", "cpu", "cuda")


@dataclass
class RunModel:
    """A run's weights loaded for generation: Transformers' model (eval mode) and the run's tokenizer."""

    weights: RunWeights
    model: nn.Module
    tokenizer: Any
    device: torch.device
    step: int | None  # the checkpoint's step (None for an export)


def run_config(run_dir: Path) -> RunConfig:
    """The RunConfig a run was started with (its config.json, without the fields the trainer added)."""
    try:
        saved = RunDir(run_dir).read_config()
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot read the config of run {run_dir}: {err}") from err
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    try:
        return RunConfig.from_dict({k: v for k, v in saved.items() if k in fields})
    except ConfigError as err:
        raise ConfigError(f"run {run_dir.name}'s config.json is not a RunConfig this workbench reads: {err}") from err


def pick_device(kind: str) -> torch.device:
    """A device `kind`: "auto" is the first CUDA GPU if there is one, else the CPU; "cpu" or "cuda" as asked."""
    if kind not in DEVICES:
        raise ConfigError(f"device must be one of {list(DEVICES)}, got {kind!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' needs a CUDA GPU, and torch sees none here: use device 'cpu' (or 'auto')")
    return du.pick_device(kind)


def load_run_model(weights: RunWeights, device: str = "auto") -> RunModel:
    """`weights` in Transformers' class on `device`, with the run's tokenizer; refusals come before a weight is read."""
    rc = run_config(weights.run_dir)
    _check_base_folder(rc, weights)
    target = pick_device(device)
    # An export holds its own config.json; a checkpoint's model is the run's (its preset or model.path)
    hf_config = read_hf_config(weights.path) if weights.source == EXPORT else rc.model.hf_config()
    tokenizer = _tokenizer(rc, hf_config)
    dtype = model_dtype(rc.model, target)
    if weights.source == EXPORT:
        model, step = _from_export(weights.path, dtype), None
    else:
        model, step = _from_checkpoint(rc, hf_config, weights.path, target, dtype)
    model.to(target).eval()
    return RunModel(weights, model, tokenizer, target, step)


def _check_base_folder(rc: RunConfig, weights: RunWeights) -> None:
    """Refuse a run built from a model.path folder that is gone, where it still needs it (before anything loads)."""
    if rc.model.path is None or Path(rc.model.path).expanduser().is_dir():
        return
    if weights.source == EXPORT and rc.data.tokenizer:
        return  # the export holds the whole model and data.tokenizer names the tokenizer
    needs = (
        "its checkpoint holds what training changed, the rest comes from that folder"
        if weights.source != EXPORT
        else "its tokenizer came from that folder (the run's data.tokenizer is unset)"
    )
    raise ConfigError(
        f"run {weights.run_dir.name} was built from model.path {rc.model.path}, which is gone; {needs}: put it "
        "back there"
    )


def _tokenizer(rc: RunConfig, hf_config: Any):
    """The tokenizer the run's data was tokenized with (data.tokenizer, the model folder's own, or the shipped one)."""
    path = resolve_tokenizer_dir(rc.data, rc.model.path)
    tokenizer = load_tokenizer(path, require_template=False)
    check_vocab(len(tokenizer), path, hf_config.vocab_size)
    return tokenizer


def _from_export(path: Path, dtype: torch.dtype) -> nn.Module:
    # safetensors only (a pickled .bin is never read) and no code from the folder (no auto_map)
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, local_files_only=True, use_safetensors=True, trust_remote_code=False
    )


def _from_checkpoint(
    rc: RunConfig, hf_config: Any, ckpt: Path, device: torch.device, dtype: torch.dtype
) -> tuple[nn.Module, int]:
    # The checks a resume makes, cheapest first and all before the build: files against the manifest,
    # the model's shape, and a LoRA run's base against the one its adapters were trained on.
    meta = verify_checkpoint(ckpt)
    check_compatible(ckpt, hf_config)
    saved = saved_base(ckpt, meta)
    description = describe_base(rc)
    check_base_description(ckpt, saved, description)
    check_base_weights(ckpt, saved, base_record(description))
    # The engine model only carries the weights into Transformers' class: the backends this device
    # runs by default build it (the run's own may be kernels of another device).
    backend = BackendConfig().resolve(device, world_size=1)
    torch.manual_seed(rc.train.seed)
    engine = build_model(rc, hf_config, None, device, dtype, backend)
    step = load_model_weights(ckpt, engine)
    state = merged_state_dict(engine) if engine_state(engine).lora is not None else full_state_dict(engine)
    del engine
    return transformers_twin(hf_config, state), step


def transformers_twin(hf_config: Any, state: dict[str, torch.Tensor]) -> nn.Module:
    """Transformers' own class for `hf_config` holding `state` (on the CPU), its rotary tables computed as it does."""
    twin = meta_model(hf_config)
    # Buffers no state dict holds (rotary frequencies): real storage, then Transformers' own init of them,
    # before the weights are assigned (the init of a module may also draw its parameters).
    for module in twin.modules():
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta and name in module._non_persistent_buffers_set:
                module._buffers[name] = torch.empty_like(buf, device="cpu")
    init_nonpersistent_buffers(twin)
    twin.load_state_dict(state, assign=True, strict=True)
    twin.tie_weights()
    return twin
