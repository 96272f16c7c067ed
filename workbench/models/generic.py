"""The generic engine path: any Transformers v5 model whose experts are `@use_experts_implementation` modules.

The family's router, shared experts, attention and aux loss formula stay Transformers'; each experts
module becomes the engine's (workbench.moe.hf_experts) with the same parameter names and fused
layout, so state dicts and Transformers' own save/load conversions are unchanged.
"""

from __future__ import annotations

import functools
import logging
import zlib
from collections.abc import Callable

import torch
from torch import nn

from workbench.kernels.rms_norm import RMSNorm
from workbench.models.attention_sinks import select_attention
from workbench.models.families import REGISTERED, family_for
from workbench.models.generic_extras import install_extras
from workbench.models.meta_model import meta_model
from workbench.models.phase_labels import label_phases
from workbench.moe.hf_experts import (
    engine_experts_modules,
    install_engine_experts,
    is_fused_experts,
    own_forward_refusal,
)
from workbench.moe.routed_load import LOAD_BUFFER
from workbench.params import num_experts as config_num_experts

log = logging.getLogger(__name__)

# Families without a folder of their own (models/families/) whose logits and gradients the tests compare with
# vanilla Transformers (tests/generic_families.py holds their tiny configs).
TESTED_WITHOUT_FOLDER = (
    "ernie4_5_moe",
    "glm4_moe",
    "hunyuan_v1_moe",
    "minimax_m2",
    "qwen2_moe",
)
# Every family the tests compare with vanilla Transformers (tests/test_generic_families.py): those above and every
# registered family (its folder holds the tiny config the tests build).
TESTED_FAMILIES = tuple(sorted(TESTED_WITHOUT_FOLDER + tuple(f.model_type for f in REGISTERED)))


class UnsupportedModelError(ValueError):
    """A MoE model whose experts are not Transformers v5 fused experts modules."""


def fused_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every v5 fused experts module of `model`, in module order."""
    return [(n, m) for n, m in model.named_modules() if is_fused_experts(m)]


class _SameConfig:
    """A config as a cache key: its class and every field (PretrainedConfig defines == but no hash)."""

    __slots__ = ("config", "key")

    def __init__(self, config) -> None:
        self.config = config
        self.key = (type(config), config.to_json_string(use_diff=False))

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other) -> bool:
        return isinstance(other, _SameConfig) and self.key == other.key


def has_fused_experts(config) -> bool:
    """Whether `config`'s model holds v5 fused experts modules; a MoE model without them is refused.

    A pure function of the config's class and fields: a memo of the answer (not of the config,
    which may change: the key is taken at each call) spares the builders and the trainer's mesh
    checks one meta build each for an equal config.
    """
    return _has_fused_experts(_SameConfig(config))


@functools.lru_cache(maxsize=32)
def _has_fused_experts(same: _SameConfig) -> bool:
    config = same.config
    model = meta_model(config)
    if fused_experts_modules(model):
        check_experts_forwards(model)
        return True
    expert_lists = [n for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "experts"]
    if config_num_experts(config) or expert_lists:
        raise UnsupportedModelError(
            f"model_type {getattr(config, 'model_type', None)!r} is a Mixture-of-Experts model whose experts are "
            f"not Transformers v5 fused experts modules (@use_experts_implementation), which the engine needs. "
            f"Supported: every family with v5 fused experts (tested: {', '.join(TESTED_FAMILIES)}); "
            "upgrade transformers if a newer version fuses this family's experts"
        )
    return False


def check_experts_forwards(model: nn.Module) -> None:
    """Refuse experts whose class adds steps to Transformers' decorated forward that the engine would skip, unless
    the family's expert rows reproduce them (Family.experts_forwards); asked on the meta model, before any weights."""
    model_type = model.config.model_type
    honoured = family_for(model_type).experts_forwards
    for name, module in fused_experts_modules(model):
        refusal = own_forward_refusal(module, honoured)
        if refusal is not None:
            raise UnsupportedModelError(f"model_type {model_type!r}: {name} is not run by the engine: {refusal}")


def validate_config(config) -> None:
    """Refuse routing settings Transformers would fail on deep inside a forward, before any weights are built."""
    experts = config_num_experts(config)
    top_k = getattr(config, "num_experts_per_tok", None)
    if experts and isinstance(top_k, int) and not 1 <= top_k <= experts:
        raise ValueError(
            f"num_experts_per_tok={top_k} must be between 1 and num_experts={experts}: lower "
            "num_experts_per_tok or add experts"
        )


def num_experts(model: nn.Module, config) -> int:
    """Routed experts per MoE layer, read from the experts modules (the config field names differ)."""
    counts = {int(getattr(m, "num_experts", 0) or m.down_proj.shape[0]) for _, m in fused_experts_modules(model)}
    if len(counts) != 1:
        raise UnsupportedModelError(
            f"model_type {config.model_type!r}: experts modules with different expert "
            f"counts {sorted(counts)}; the engine needs one count per model"
        )
    return counts.pop()


def install(
    model: nn.Module,
    backend,
    make_dispatcher,
    expert_range: tuple[int, int] | None = None,
    device: torch.device | None = None,
) -> int:
    """Make every fused experts module the engine's, then the extras `backend` (resolved) selects.

    `make_dispatcher(num_experts)` gives each experts module its dispatcher; `device`: the one
    `backend` was resolved for (None: where the weights are now).
    """
    total = num_experts(model, model.config)
    model_type = model.config.model_type
    family = family_for(model_type)  # what the family adds to this path (models/families/<model_type>/)
    modules = fused_experts_modules(model)
    for _, module in modules:
        install_engine_experts(
            module,
            make_dispatcher(total),
            backend.experts,
            expert_range or (0, total),
            total,
            gate=backend.gate,
            swiglu=backend.swiglu,
            recompute=backend.expert_recompute,
            device=device,
            wgrad=backend.expert_wgrad,
            family_rows=family.expert_rows(module, backend.swiglu),
            honoured=family.experts_forwards,
        )
    select_attention(model, backend.attention, family.sinks_by_default)
    extras = install_extras(model, backend, total, family)
    extras["phase_labels"] = label_phases(model)
    # One line: an untested family runs too (its experts are v5-fused), but the user should know it is untested.
    tested = (
        ""
        if model_type in TESTED_FAMILIES
        else (f"; {model_type!r} is not among the families tested against Transformers ({', '.join(TESTED_FAMILIES)})")
    )
    # which parts are the engine's own: the line used to say "Transformers' router and attention" for every family,
    # also where the float32 router and the fused-RoPE attention had replaced them
    router = "the engine's float32 router" if extras.get("float32_router") else "Transformers' router"
    attention = "the engine's fused-RoPE attention" if extras.get("rope") else "Transformers' attention"
    log.warning(
        "model_type %r: generic engine path (%s, %s, the engine's experts in %d MoE layers of %d experts, "
        "backend %s)%s",
        model_type,
        router,
        attention,
        len(modules),
        total,
        backend.experts,
        tested,
    )
    log.info(
        "model_type %r extras: %s; swiglu=%s combine=%s cross_entropy=%s fused_ce=%s expert_recompute=%s",
        model_type,
        extras,
        backend.swiglu,
        backend.combine,
        backend.cross_entropy,
        backend.fused_ce,
        backend.expert_recompute,
    )
    return len(modules)


def init_random(model: nn.Module, seed: int, only: Callable[[str], bool] | None = None) -> None:
    """Transformers' own init per module, seeded by module name; each expert seeded by its id.

    Seeding per module keeps dense weights independent of how the experts are sliced, and
    seeding per (module, expert) keeps an expert's weights independent of the mesh. `only`: the
    module names to initialize (a block at a time: models/random_init.py); None, every module.
    """
    config = model.config
    std = getattr(config, "initializer_range", None) or 0.02
    engine = dict(engine_experts_modules(model))
    # Where the weights are drawn (a blockwise build leaves blocks not yet materialized on meta)
    device = next((t.device for t in model.parameters() if t.device.type != "meta"), torch.device("cpu"))
    with torch.no_grad():
        for name, module in model.named_modules():
            if only is not None and not only(name):
                continue
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
                model._init_weights(module)
                if isinstance(module, RMSNorm) and module.offset:
                    # Transformers sets a norm's weight to ones by class name: a zero-centered norm's neutral is zeros
                    module.reset_parameters()
                if type(module).__name__ == "TELinear":  # linear='te': Transformers' init skips non-nn.Linear
                    module.weight.normal_(0.0, std)
                    if module.bias is not None:
                        module.bias.zero_()
            counter = getattr(module, LOAD_BUFFER, None)
            if isinstance(counter, torch.Tensor):  # to_empty left it uninitialized
                counter.zero_()
            if name not in engine:
                continue
            first, last = module.plan.expert_range
            for pname in module.plan.layout.param_names():
                param = getattr(module, pname)
                if pname.endswith("_bias"):
                    param.zero_()
                    continue
                for local, e in enumerate(range(first, last)):
                    g = torch.Generator(device=device).manual_seed(zlib.crc32(f"{seed}/{name}/{pname}/{e}".encode()))
                    param[local].normal_(0.0, std, generator=g)
