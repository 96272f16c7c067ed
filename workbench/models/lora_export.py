"""Export a LoRA run: a PEFT adapter folder, a vLLM adapter folder, or the merged model.

PEFT (`peft.PeftModel.from_pretrained(vanilla_model, folder)`): nn.Linear adapters under their
module's name (`base_model.model.<name>.lora_A.weight` [r, in], `lora_B.weight` [out, r]); fused
experts through `target_parameters` (PEFT's ParamWrapper on the `[E, ...]` parameter): `lora_A.weight`
[E * r, in] with expert e's rows at [e * r, (e + 1) * r), `lora_B.weight` [out, r * E] with expert e's
rank-j column at j * E + e. Two targeted parameters of one module nest: the one defined first in the
module sits under `.base_layer` (PEFT wraps parameters in definition order).

vLLM (its per-expert "2D" MoE adapters): every expert's gate/up/down as its own nn.Linear adapter,
named as the family's per-expert checkpoint names them (`...mlp.experts.<e>.gate_proj.lora_A.weight`),
gate and up sharing A. Read from Transformers' own per-expert -> fused conversion rules, so only
families stored per expert on disk have this form.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from workbench.models.engine_state import engine_state
from workbench.models.export_folder import check_export_folder, write_whole
from workbench.models.full_state import full_state_dict
from workbench.models.lora import is_adapter_name
from workbench.models.meta_model import meta_model
from workbench.models.sliced_load import disk_rules
from workbench.moe.lora_experts import adapter_names, expert_delta

log = logging.getLogger(__name__)

# Shape suffixes: E experts, I in features, O out features, R LoRA rank.

PEFT_PREFIX = "base_model.model."
ADAPTER_SUBDIR = "adapter"  # save_pretrained of a LoRA model: the PEFT adapter beside the merged model
# PEFT (0.21) reads these leaf names in target_modules as Transformers v4's per-expert projections of a
# family it converts (qwen2_moe-like, mixtral) and turns them into the fused experts' parameters with
# doubled rank, which then refuse the adapter. A shared expert's or dense MLP's nn.Linear of such a
# name is therefore targeted as a parameter (`<name>.weight`): PEFT's ParamWrapper on a 2-D weight is
# the same LoRA (lora_A [r, in], lora_B [out, r], same keys), and that list is not converted.
PEFT_CONVERTED_LEAVES = ("gate", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
# PEFT (0.21) refuses to put LoRA on these leaf modules of these model types, as a module or as a parameter, so it
# cannot load an adapter folder holding them (mamba_ssm's fused kernels read out_proj's weight directly, past any
# adapter on the module). The engine's LoRA on them trains and merges like any other: the merged export carries it.
PEFT_MAMBA_TYPES = ("falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h")
PEFT_MAMBA_REFUSED = ("out_proj", "conv1d")


def _is_rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _lora_of(model: nn.Module):
    state = engine_state(model)
    if state.lora is None:
        raise ValueError("this model has no LoRA adapters (build it with lora=LoraConfig(...) or RunConfig.lora)")
    return state.lora, state.lora_plan


def _full(model: nn.Module, tensor: torch.Tensor, expert: bool) -> torch.Tensor:
    """`tensor` whole on the CPU: unsharded (FSDP2), and its experts gathered over ep where `expert`."""
    from torch.distributed.tensor import DTensor

    full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor.detach()
    state = engine_state(model)
    mesh = state.mesh
    if expert and mesh is not None and mesh.ep > 1:
        parts = [torch.empty_like(full) for _ in range(mesh.ep)]
        dist.all_gather(parts, full.contiguous(), group=state.device_mesh.get_group("ep"))
        full = torch.cat(parts)
    return full.cpu()


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every adapter of `model`, whole, on the CPU, under the model's parameter names; collective."""
    _, plan = _lora_of(model)
    out = {}
    for name in plan.linears:
        module = model.get_submodule(name)
        for part in ("lora_A", "lora_B"):
            out[f"{name}.{part}.weight"] = _full(model, getattr(module, part).weight, expert=False)
    for name, weights in plan.experts:
        module = model.get_submodule(name)
        for weight in weights:
            for pname in adapter_names(weight):
                out[f"{name}.{pname}"] = _full(model, getattr(module, pname), expert=True)
    return out


def _nesting(module: nn.Module, weights: tuple[str, ...]) -> dict[str, str]:
    # PEFT wraps a module's targeted parameters in their definition order, each wrapper around the last.
    order = [n for n, _ in module.named_parameters(recurse=False) if n in weights]
    return {w: ".base_layer" * (len(order) - 1 - i) for i, w in enumerate(order)}


def peft_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`adapter_tensors` under PEFT's names and shapes."""
    _, plan = _lora_of(model)
    out = {}
    for name in plan.linears:
        for part in ("lora_A", "lora_B"):
            out[f"{PEFT_PREFIX}{name}.{part}.weight"] = tensors[f"{name}.{part}.weight"].contiguous()
    for name, weights in plan.experts:
        infix = _nesting(model.get_submodule(name), weights)
        for weight in weights:
            name_a, name_b = adapter_names(weight)
            a_EIR, b_ERO = tensors[f"{name}.{name_a}"], tensors[f"{name}.{name_b}"]
            experts, fan_in, rank = a_EIR.shape
            key = f"{PEFT_PREFIX}{name}{infix[weight]}"
            out[f"{key}.lora_A.weight"] = a_EIR.permute(0, 2, 1).reshape(experts * rank, fan_in).contiguous()
            out[f"{key}.lora_B.weight"] = b_ERO.permute(2, 1, 0).reshape(b_ERO.shape[2], rank * experts).contiguous()
    return out


def peft_config(model: nn.Module, base_model_name_or_path: str | None = None) -> dict:
    """The adapter_config.json PEFT reads back (LoRA, alpha / r scaling, full module and parameter names)."""
    lora, plan = _lora_of(model)
    as_params = [n for n in plan.linears if n.rsplit(".", 1)[-1] in PEFT_CONVERTED_LEAVES]
    modules = [n for n in plan.linears if n not in as_params]
    params = [f"{name}.{w}" for name, weights in plan.experts for w in weights] + [f"{n}.weight" for n in as_params]
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        # PEFT refuses dropout on target_parameters; dropout only acts in training, so logits are the same.
        "lora_dropout": 0.0 if params else lora.dropout,
        "target_modules": sorted(modules) or None,
        "target_parameters": params or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "base_model_name_or_path": base_model_name_or_path,
    }


def _write(out_dir, tensors: dict[str, torch.Tensor], config: dict) -> Path:
    from safetensors.torch import save_file

    def write(folder: Path) -> None:
        folder.mkdir()
        save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
        (folder / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    return write_whole(Path(out_dir), "adapter", write)


def _finish() -> None:
    if dist.is_initialized():
        dist.barrier()


def peft_refusal(model: nn.Module) -> str | None:
    """Why PEFT cannot load `model`'s adapter folder (PEFT_MAMBA_REFUSED adapters of a Mamba model), or None."""
    _, plan = _lora_of(model)
    model_type = model.config.model_type
    refused = [n for n in plan.linears if n.rsplit(".", 1)[-1] in PEFT_MAMBA_REFUSED]
    if model_type not in PEFT_MAMBA_TYPES or not refused:
        return None
    leaves = sorted({n.rsplit(".", 1)[-1] for n in refused})
    return (
        f"PEFT refuses LoRA on {leaves} of Mamba models (model_type {model_type!r}; here on {refused[0]} and "
        f"{len(refused) - 1} more, which lora.targets 'mixer' adapts), so it could not load this adapter folder"
    )


def save_lora_adapter(model: nn.Module, out_dir, base_model_name_or_path: str | None = None) -> Path:
    """Write the PEFT adapter folder of a LoRA model from any mesh; collective: every rank calls it.

    Refused (before anything is written) where PEFT could not load it (peft_refusal)."""
    out_dir = Path(out_dir)
    why = peft_refusal(model)
    if why is not None:
        raise ValueError(
            f"{why}: save_merged(model, dir) writes the model with every adapter folded in, which vanilla "
            "Transformers loads; for a PEFT adapter train without 'mixer' in lora.targets"
        )
    check_export_folder(out_dir, "adapter")  # on every rank, before the gathers
    tensors = adapter_tensors(model)
    if _is_rank0():
        _write(out_dir, peft_tensors(model, tensors), peft_config(model, base_model_name_or_path))
    _finish()
    return out_dir


def _vllm_expert_keys(model_type: str, name: str, weight: str):
    """(per-expert disk names with '{e}', concat dim) of fused weight `name.weight`, or None."""
    rules = disk_rules(model_type)
    key = f"{name}.{weight}"
    for merge in rules.merges:
        if key.endswith(merge.target):
            prefix = key[: -len(merge.target)]
            names = []
            for source in merge.sources:
                disk = (prefix + source.replace("*", "{e}")).removesuffix(".weight")
                for disk_part, memory_part in rules.renames:
                    disk = disk.replace(memory_part, disk_part)
                names.append(disk)
            return names, merge.concat_dim
    return None


def vllm_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`adapter_tensors` in vLLM's per-expert (2D) MoE adapter layout."""
    _, plan = _lora_of(model)
    model_type = model.config.model_type
    out = {
        k: v
        for k, v in peft_tensors(model, tensors).items()
        if not any(k.startswith(f"{PEFT_PREFIX}{n}.") for n, _ in plan.experts)
    }
    for name, weights in plan.experts:
        module = model.get_submodule(name)
        for weight in weights:
            found = _vllm_expert_keys(model_type, name, weight)
            out_dim = 2 if module.plan.layout.is_transposed else 1
            if found is None or (len(found[0]) > 1 and found[1] != out_dim):
                raise ValueError(
                    f"model_type {model_type!r} keeps {name}.{weight} fused on disk: vLLM's per-expert "
                    "LoRA layout does not apply; export the PEFT adapter (save_lora_adapter), whose "
                    "target_parameters form is the fused one"
                )
            names, _ = found
            name_a, name_b = adapter_names(weight)
            a_EIR, b_ERO = tensors[f"{name}.{name_a}"], tensors[f"{name}.{name_b}"]
            for e in range(a_EIR.shape[0]):
                chunks = b_ERO[e].chunk(len(names), dim=1)  # gate | up along the output features
                for disk, b_RO in zip(names, chunks):
                    base = PEFT_PREFIX + disk.format(e=e)
                    out[f"{base}.lora_A.weight"] = a_EIR[e].t().contiguous()
                    out[f"{base}.lora_B.weight"] = b_RO.t().contiguous()
    return out


def save_vllm_adapter(model: nn.Module, out_dir, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapter in vLLM's per-expert MoE layout; collective: every rank calls it."""
    out_dir = Path(out_dir)
    check_export_folder(out_dir, "adapter")  # on every rank, before the gathers
    tensors = adapter_tensors(model)
    if _is_rank0():
        converted = vllm_tensors(model, tensors)
        config = peft_config(model, base_model_name_or_path)
        leaves = {k[len(PEFT_PREFIX) :].rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for k in converted}
        config.update(target_modules=sorted(leaves), target_parameters=None, lora_dropout=0.0)
        _write(out_dir, converted, config)
    _finish()
    return out_dir


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base state dict with every adapter folded in (W + scaling * update), no adapter keys; collective."""
    _, plan = _lora_of(model)
    tensors = adapter_tensors(model)
    state = {k: v for k, v in full_state_dict(model, to_rank0_only=True).items() if not is_adapter_name(k)}
    if not _is_rank0():
        return {}
    for name in plan.linears:
        module = model.get_submodule(name)
        b_OR, a_RI = tensors[f"{name}.lora_B.weight"].float(), tensors[f"{name}.lora_A.weight"].float()
        delta = (b_OR @ a_RI) * module.lora_scaling
        key = f"{name}.weight"
        state[key] = (state[key].float() + delta).to(state[key].dtype)
    for name, weights in plan.experts:
        module = model.get_submodule(name)
        for weight in weights:
            name_a, name_b = adapter_names(weight)
            a_EIR, b_ERO = tensors[f"{name}.{name_a}"].float(), tensors[f"{name}.{name_b}"].float()
            delta = expert_delta(module, weight, a_EIR, b_ERO)
            key = f"{name}.{weight}"
            state[key] = (state[key].float() + delta).to(state[key].dtype)
    return state


def save_merged(model: nn.Module, out_dir, max_shard_size: str = "5GB") -> Path:
    """Write the merged model (base + LoRA folded) in the Transformers layout; collective."""
    out_dir = Path(out_dir)
    check_export_folder(out_dir, "model")  # on every rank, before the gathers
    state = merged_state_dict(model)
    if _is_rank0():
        twin = meta_model(model.config)  # Transformers' own class: its save writes the family's disk layout
        twin.load_state_dict(state, assign=True, strict=True)
        twin.tie_weights()
        write_whole(out_dir, "model", lambda folder: twin.save_pretrained(folder, max_shard_size=max_shard_size))
    _finish()
    return out_dir


def save_lora_model(model: nn.Module, out_dir, max_shard_size: str = "5GB") -> Path:
    """A LoRA model's save_pretrained: the merged model in `out_dir`, the PEFT adapter in `out_dir/adapter`.

    The adapter sits in a subfolder: an adapter_config.json at the top would make Transformers try to
    load the folder as an adapter; where PEFT could not load it (peft_refusal) only the merged model is written,
    and a warning says why. Collective.
    """
    out_dir = Path(out_dir)
    save_merged(model, out_dir, max_shard_size)
    why = peft_refusal(model)
    if why is None:
        save_lora_adapter(model, out_dir / ADAPTER_SUBDIR)
    elif _is_rank0():
        log.warning(
            "%s: %s holds the merged model only (the adapters folded in), no %s/ folder", why, out_dir, ADAPTER_SUBDIR
        )
    return out_dir
