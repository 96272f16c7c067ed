"""Read only this rank's tensors of a Transformers checkpoint into a generic-path model on a mesh.

Every dense tensor is read whole, and of each experts tensor only this rank's experts [first, last):
rows of a tensor that is fused on disk too (GPT-OSS), or the per-expert tensors that Transformers
merges into the fused in-memory layout (`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's
`block_sparse_moe.experts.{e}.w1/w3/w2`). Which disk keys make which fused tensor is read from
Transformers' own conversion rules for the family (transformers.conversion_mapping), so a family
is followed as Transformers loads it; a rule this reader cannot follow makes `plan_rank_read`
return None and the caller lets Transformers load the whole checkpoint.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from workbench.errors import CheckpointError
from workbench.models.hf_io import checkpoint_key_files
from workbench.moe.hf_experts import EngineExperts, is_fused_experts, layout_of
from workbench.moe.routed_load import load_counters

_LITERAL = re.compile(r"[\w.]+")  # a rule pattern the reader follows: no regex beyond '.'


@dataclass(frozen=True)
class ExpertMerge:
    """Transformers' per-expert -> fused rule: disk `sources` (with '*' for the expert id) make `target`."""

    sources: tuple[str, ...]
    target: str
    concat_dim: int | None  # the fused tensor's dim the sources are concatenated along (gate|up), None: one source


@dataclass(frozen=True)
class DiskRules:
    """What the reader knows of a family's disk layout, from Transformers' conversion mapping."""

    renames: tuple[tuple[str, str], ...]  # (disk, in-memory) substrings
    merges: tuple[ExpertMerge, ...]
    unknown: tuple[str, ...]  # rules it cannot follow (named in the fallback's log line)


@dataclass(frozen=True)
class Source:
    """Where one in-memory tensor comes from: `keys` whole, rows [first, last) of `keys[0]`, or per expert."""

    name: str
    keys: tuple[str, ...]  # disk keys; per-expert ones hold "{e}"
    kind: str  # "whole" | "expert_rows" | "per_expert"
    concat_dim: int | None = None


@dataclass(frozen=True)
class ReadPlan:
    """What this rank reads: the disk source per state-dict name, and the file of each disk key (parsed once)."""

    sources: dict[str, Source]
    where: dict[str, Path]


@dataclass(frozen=True)
class ReadStats:
    """What one rank read from the checkpoint (bytes of the tensors it got, experts counted apart)."""

    tensors: int
    bytes: int
    expert_bytes: int


def disk_rules(model_type: str) -> DiskRules:
    """The family's conversion rules from Transformers (the same objects its loader runs)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

    renames, merges, unknown = [], [], []
    for rule in get_checkpoint_conversion_mapping(model_type) or []:
        sources, targets = list(rule.source_patterns), list(rule.target_patterns)
        literal = all(_LITERAL.fullmatch(p.replace("*", "")) for p in sources + targets)
        if type(rule) is WeightRenaming and literal and len(sources) == len(targets) == 1:
            renames.append((sources[0], targets[0]))
            continue
        ops = list(getattr(rule, "operations", ()))
        stacks = bool(ops) and type(ops[0]) is MergeModulelist and ops[0].dim == 0
        concat = ops[1:] == [] or (len(ops) == 2 and type(ops[1]) is Concatenate and ops[1].dim >= 1)
        if (
            type(rule) is WeightConverter
            and literal
            and stacks
            and concat
            and len(targets) == 1
            and all(p.count("*") == 1 for p in sources)
        ):
            merges.append(ExpertMerge(tuple(sources), targets[0], ops[1].dim if len(ops) == 2 else None))
            continue
        unknown.append(f"{type(rule).__name__}({sources} -> {targets})")
    return DiskRules(tuple(renames), tuple(merges), tuple(unknown))


def _disk_candidates(name: str, rules: DiskRules) -> list[str]:
    """`name` as it may be spelled on disk: itself, then with Transformers' renamings undone."""
    out = [name]
    for disk, memory in rules.renames:
        out += [c.replace(memory, disk) for c in list(out) if memory in c]
    return list(dict.fromkeys(out))


def _unique_tensors(model: nn.Module) -> list[list[str]]:
    """State-dict names grouped by tensor (tied weights are one group: any one name on disk fills it)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(tensor), []).append(name)
    return list(groups.values())


def _experts_params(model: nn.Module) -> tuple[set[str], int]:
    """(state-dict names of the per-expert parameters, routed experts per layer) of `model`.

    The engine's experts modules or Transformers' own fused ones (a meta twin checked before
    Transformers loads on one rank): both keep Transformers' parameter names.
    """
    params, counts = set(), set()
    for name, module in model.named_modules():
        if not is_fused_experts(module):
            continue
        layout = module.plan.layout if isinstance(module, EngineExperts) else layout_of(module)
        params.update(f"{name}.{p}" for p in layout.param_names())
        counts.add(int(getattr(module, "num_experts", 0) or module.down_proj.shape[0]))
    return params, counts.pop()


def plan_rank_read(model: nn.Module, path: Path, expert_range: tuple[int, int]) -> ReadPlan | None:
    """Per state-dict name of `model`, its disk source; None: a layout unknown here.

    `model`: engine experts installed (this rank's slice), or Transformers' model on the meta device.
    Raises CheckpointError for a tensor the family's rules say must be on disk but that is missing or
    of a shape the model does not take, for any expert (not only this rank's), from the files' headers:
    every rank then refuses alike, none waits in a collective, and nothing is read before it.
    """
    path = Path(path)
    if getattr(model.config, "quantization_config", None) is not None:
        return None  # quantized weights (e.g. GPT-OSS MXFP4 blocks) go through Transformers' quantizer
    where = checkpoint_key_files(path)
    on_disk = set(where)
    rules = disk_rules(model.config.model_type)
    expert_params, num_experts = _experts_params(model)
    plan: dict[str, Source] = {}
    for names in _unique_tensors(model):
        source = None
        for name in names:
            found = next((c for c in _disk_candidates(name, rules) if c in on_disk), None)
            if found is not None:
                source = Source(name, (found,), "expert_rows" if name in expert_params else "whole")
                break
            if name in expert_params:
                source = _per_expert_source(name, rules, on_disk)
                if source is not None:
                    break
        if source is None:
            if rules.unknown:
                return None  # a rule the reader cannot follow may name it: Transformers loads the checkpoint
            raise CheckpointError(
                f"checkpoint {path} does not fit its config ({model.config.model_type}): missing "
                f"tensors {[_disk_candidates(names[0], rules)[-1]]}. Point to a complete checkpoint "
                "written by save_pretrained, or fix config.json"
            )
        plan[names[0]] = source
    _check_headers(model, path, where, plan, num_experts)
    return ReadPlan(plan, where)


def _disk_shape(source: Source, in_memory: tuple[int, ...], num_experts: int) -> tuple[int, ...] | None:
    """The shape each disk tensor of `source` must have for the model's `in_memory` shape (None: not known)."""
    if source.kind == "whole":
        return in_memory
    if source.kind == "expert_rows":  # the model may hold a slice of the experts: the file holds them all
        return (num_experts, *in_memory[1:])
    one = list(in_memory[1:])  # per expert: the sources are stacked, then concatenated along concat_dim
    if source.concat_dim is not None:
        dim, parts = source.concat_dim - 1, len(source.keys)
        if one[dim] % parts:
            return None
        one[dim] //= parts
    return tuple(one)


def _check_headers(
    model: nn.Module, path: Path, where: dict[str, Path], plan: dict[str, Source], num_experts: int
) -> None:
    """Every planned tensor, of every expert, is on disk in the shape the model takes (headers only)."""
    state = model.state_dict(keep_vars=True)
    files: dict[Path, object] = {}
    with ExitStack() as stack:
        for source in plan.values():
            expected = _disk_shape(source, tuple(state[source.name].shape), num_experts)
            per_key = (
                [[k.format(e=e) for e in range(num_experts)] for k in source.keys]
                if source.kind == "per_expert"
                else [[k] for k in source.keys]
            )
            for keys in per_key:
                missing = [k for k in keys if k not in where]
                if missing:
                    raise CheckpointError(
                        f"checkpoint {path} does not fit its config: missing tensors {missing[:8]}"
                        f"{'...' if len(missing) > 8 else ''} (experts of {source.name}). Point to "
                        "a complete checkpoint written by save_pretrained, or fix config.json"
                    )
                for k in keys:
                    if where[k] not in files:
                        files[where[k]] = stack.enter_context(safe_open(where[k], framework="pt"))
                    shape = tuple(files[where[k]].get_slice(k).get_shape())
                    if expected is not None and shape != expected:
                        raise CheckpointError(
                            f"checkpoint {path}: tensor {k} in {where[k]} has shape {shape}; the model its "
                            f"config describes ({model.config.model_type}, {num_experts} experts) takes "
                            f"{expected}: the checkpoint is of another model shape. Point to a checkpoint of "
                            "this config, or fix config.json"
                        )


def _per_expert_source(name: str, rules: DiskRules, on_disk: set[str]) -> Source | None:
    """The per-expert disk keys Transformers merges into `name`, spelled as this checkpoint spells expert 0's."""
    for merge in rules.merges:
        if not name.endswith(merge.target):
            continue
        base = name[: -len(merge.target)]
        keys = []
        for pattern in merge.sources:
            candidates = _disk_candidates(base + pattern.replace("*", "{e}"), rules)
            keys.append(next((c for c in candidates if c.format(e=0) in on_disk), candidates[-1]))
        # A key absent in every spelling is the checkpoint's fault, not the layout's: _check_headers names it.
        return Source(name, tuple(keys), "per_expert", merge.concat_dim)
    return None


def read_rank_tensors(
    path: Path, read_plan: ReadPlan, expert_range: tuple[int, int]
) -> tuple[dict[str, torch.Tensor], ReadStats]:
    """This rank's tensors per planned name (experts [first, last) only), and what reading them took."""
    plan, where = read_plan.sources, read_plan.where  # the key -> file map plan_rank_read parsed
    first, last = expert_range
    wanted: list[str] = []
    for source in plan.values():
        if source.kind == "per_expert":
            wanted += [k.format(e=e) for k in source.keys for e in range(first, last)]
        else:
            wanted += list(source.keys)
    missing = [k for k in wanted if k not in where]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} is missing tensors {missing[:8]}{'...' if len(missing) > 8 else ''}; "
            "point to a complete checkpoint written by save_pretrained, or fix config.json"
        )
    rows_of = {s.keys[0] for s in plan.values() if s.kind == "expert_rows"}
    dense = {s.keys[0] for s in plan.values() if s.kind == "whole"}
    by_file: dict[Path, list[str]] = {}
    for key in dict.fromkeys(wanted):
        by_file.setdefault(where[key], []).append(key)
    raw: dict[str, torch.Tensor] = {}
    for file, keys in by_file.items():
        with safe_open(file, framework="pt") as f:
            for key in keys:
                raw[key] = f.get_slice(key)[first:last] if key in rows_of else f.get_tensor(key)
    total = sum(t.numel() * t.element_size() for t in raw.values())
    expert_bytes = sum(raw[k].numel() * raw[k].element_size() for k in raw if k not in dense)
    count = len(raw)
    out = {}
    for name, source in plan.items():  # each raw tensor is dropped once assembled
        if source.kind == "per_expert":
            experts = []
            for e in range(first, last):
                parts = [raw.pop(k.format(e=e)) for k in source.keys]
                # Transformers stacks each source over experts, then concatenates the stacks along concat_dim.
                experts.append(torch.cat(parts, dim=source.concat_dim - 1) if source.concat_dim else parts[0])
            out[name] = torch.stack(experts)
        else:
            out[name] = raw.pop(source.keys[0])
    return out, ReadStats(tensors=count, bytes=total, expert_bytes=expert_bytes)


def load_rank_slice(model: nn.Module, path: Path, plan: ReadPlan, expert_range: tuple[int, int]) -> ReadStats:
    """Fill `model` (allocated, engine experts installed) with this rank's tensors of the checkpoint."""
    tensors, stats = read_rank_tensors(path, plan, expert_range)
    state = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for name, value in tensors.items():
            target = state[name]
            if value.shape != target.shape:
                disk = ", ".join(plan.sources[name].keys)
                raise CheckpointError(
                    f"checkpoint {path}: {name} (from {disk}) has shape {tuple(value.shape)} for "
                    f"experts {list(expert_range)}, the model needs {tuple(target.shape)}; the "
                    "checkpoint is of another model shape"
                )
            target.copy_(value)
    return stats


def init_nonpersistent_buffers(model: nn.Module) -> None:
    """Recompute buffers no checkpoint holds (rotary tables) after `to_empty`, as Transformers' init does."""
    for module in model.modules():
        # Experts modules' only such buffer is the engine's load counter: their weights come from the checkpoint.
        if getattr(module, "_non_persistent_buffers_set", None) and not isinstance(module, EngineExperts):
            model._init_weights(module)
    for counter in load_counters(model):  # to_empty left them uninitialized
        counter.zero_()
