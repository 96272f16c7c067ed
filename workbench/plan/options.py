"""The RunConfig changes that would make a run fit, each planned as a run of its own.

Changes that keep the training the same: activation checkpointing (of every layer, or of the first eighth, quarter,
..., seven eighths of them, which recomputes less where the memory allows), 8-bit AdamW moments, a smaller local
batch (more micro-batches, the same global batch), a larger expert-parallel size, more GPUs. Changes that train
something else (`changes_training`): LoRA on a full fine-tune, a shorter data.seq_len, a global batch grown to cover
more GPUs, and updates inside the backward (one rank, no accumulation: the trainer's rule) where the run clipped its
gradients, which they cannot. Every combination of them is planned; the list keeps those that fit, drops one whose
change only adds to a faster fitting one, and is sorted fastest first. A partial checkpointing count counts as less
than a larger one: one that checkpoints more layers than a faster listed option, with no change that option lacks, is
dropped too (it only adds headroom, which checkpointing every layer, listed as well, gives most of). `train.fit: auto`
takes the fastest that keeps the training and the rank count.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from workbench.config import RunConfig
from workbench.config_checks import ConfigError
from workbench.models.generic import has_fused_experts
from workbench.params import num_experts
from workbench.plan.report import Option

MAX_OPTIONS = 8
MIN_SEQ_LEN = 512
MORE_GPUS = (2, 4, 8)  # times the run's own rank count


def _halvings(value: int, floor: int) -> list[int]:
    out = []
    while value // 2 >= floor and value % 2 == 0:
        value //= 2
        out.append(value)
    return out


# The shares of the decoder layers a partial activation checkpointing recomputes (besides all of them): eighths, so
# train.fit auto lands within an eighth of the layers of the fewest that fit (48 layers: 6 at a time)
PARTIAL_CHECKPOINTING = tuple(n / 8 for n in range(1, 8))
CHECKPOINTED_LAYERS = "train.activation_checkpointing_layers"


def _checkpointing(rc: RunConfig, hf_config: Any) -> list[dict[str, Any]]:
    """Activation checkpointing of more layers than the run recomputes now: every layer, and the first eighth,
    quarter, ..., seven eighths of them (train.activation_checkpointing_layers)."""
    train = rc.train
    layers = getattr(hf_config, "num_hidden_layers", 0) or 0
    now = 0 if not train.activation_checkpointing else (train.activation_checkpointing_layers or layers)
    counts = sorted({max(1, round(share * layers)) for share in PARTIAL_CHECKPOINTING} - {layers}) if layers else []
    out = []
    for count in [*counts, None]:
        if (count or layers) <= now:
            continue
        ac: dict[str, Any] = {"train.activation_checkpointing": True}
        if count is not None or train.activation_checkpointing_layers is not None:
            ac[CHECKPOINTED_LAYERS] = count
        if train.cuda_graphs:
            ac["train.cuda_graphs"] = False
        out.append(ac)
    return out


def _savers(rc: RunConfig, gpus: int, hf_config: Any) -> list[dict[str, Any]]:
    """The memory savers, alone (combined by candidates; the checkpointing ones are alternatives, never combined)."""
    train = rc.train
    out = _checkpointing(rc, hf_config)
    if train.optimizer_states == "full":
        eight = {"train.optimizer_states": "8bit"}
        if train.optimizer == "adamw_torch":
            eight["train.optimizer"] = "adamw"
        out.append(eight)
    if not train.optimizer_in_backward and gpus == 1:
        inb = {"train.optimizer_in_backward": True, "train.clip_grad_norm": None}
        if train.optimizer == "adamw_torch":
            inb["train.optimizer"] = "adamw"
        out.append(inb)
    return out


def _more_ranks(rc: RunConfig, gpus: int, experts: int) -> list[tuple[dict[str, Any], int, bool]]:
    """A larger ep on the run's ranks, and more ranks (the global batch grown where it must cover them)."""
    out = []
    if rc.mesh is not None:
        ep = rc.mesh.ep * 2
        while ep <= rc.mesh.dp:
            if rc.mesh.dp % ep == 0 and experts % ep == 0:
                out.append(({"mesh.dp": rc.mesh.dp, "mesh.ep": ep}, gpus, False))
            ep *= 2
    for factor in MORE_GPUS:
        more = gpus * factor
        change: dict[str, Any] = {}
        if rc.mesh is not None:
            change = {"mesh.dp": more, "mesh.ep": more if experts and experts % more == 0 else rc.mesh.ep}
        grows = rc.train.global_batch_size % (rc.train.local_batch_size * more) != 0
        if grows:
            change["train.global_batch_size"] = rc.train.local_batch_size * more
        out.append((change, more, grows))
    return out


def candidates(
    rc: RunConfig, gpus: int, hf_config: Any, more_ranks: bool = True
) -> list[tuple[dict[str, Any], int, bool]]:
    """(change, gpus, changes_training) for the combinations the module docstring lists: every combination of the
    savers and the smaller local batches on the run's ranks; more ranks or a larger ep, and LoRA or a shorter sequence,
    each alone and with activation checkpointing. `more_ranks` False: no larger mesh (CPU ranks share one host's
    memory)."""
    savers = _savers(rc, gpus, hf_config)
    out: list[tuple[dict[str, Any], int, bool]] = []
    for count in range(len(savers) + 1):
        for chosen in itertools.combinations(savers, count):
            if sum("train.activation_checkpointing" in c for c in chosen) > 1:
                continue  # two checkpointing counts: one would overwrite the other
            for batch in [None, *_halvings(rc.train.local_batch_size, 1)]:
                change: dict[str, Any] = {}
                for c in chosen:
                    change.update(c)
                if batch is not None:
                    change["train.local_batch_size"] = batch
                if change:
                    # updates in the backward cannot clip by the global norm: a run that clipped trains otherwise
                    unclipped = "train.clip_grad_norm" in change and rc.train.clip_grad_norm is not None
                    out.append((change, gpus, unclipped))
    others = _more_ranks(rc, gpus, num_experts(hf_config)) if more_ranks else []
    if rc.lora is None and num_experts(hf_config) and has_fused_experts(hf_config):
        others.append(({"lora.rank": 16}, gpus, True))
    others += [({"data.seq_len": seq}, gpus, True) for seq in _halvings(rc.data.seq_len, MIN_SEQ_LEN)[:2]]
    checkpointing = [{}] + [c for c in savers if "train.activation_checkpointing" in c]
    for change, n, changes_training in others:
        for extra in checkpointing:
            out.append(({**extra, **change}, n, changes_training))
    return out


def fitting_options(
    rc: RunConfig,
    gpus: int,
    hf_config: Any,
    evaluate: Callable[[RunConfig, int], tuple[float, bool, float]],
    more_ranks: bool = True,
) -> tuple[Option, ...]:
    """The options that fit (module docstring); `evaluate(rc, gpus)` -> (peak GiB, fits, tokens/s per GPU)."""
    found: list[Option] = []
    for change, n, changes_training in candidates(rc, gpus, hf_config, more_ranks):
        try:
            changed = rc.with_overrides(change)
            peak, fits, speed = evaluate(changed, n)
        except (ConfigError, ValueError):  # a combination the trainer would refuse (batch sizes, mesh)
            continue
        if fits:
            found.append(Option(change, n, peak, fits, speed, changes_training))
    found.sort(key=lambda o: -o.tokens_per_s_per_gpu)
    kept: list[Option] = []
    for option in found:  # fastest first: a later one that only adds changes to a kept one is not worth listing
        items = set(map(repr, option.change.items()))
        if any(k.gpus == option.gpus and set(map(repr, k.change.items())) <= items for k in kept):
            continue
        if any(_checkpoints_fewer_with_less(k, option) for k in kept):
            continue  # a faster one recomputes fewer layers with no other change this one lacks
        kept.append(option)
    return tuple(kept[:MAX_OPTIONS])


def _checkpoints_fewer_with_less(kept: Option, option: Option) -> bool:
    """Whether `kept` checkpoints some of the layers, no more than `option` does, on as many ranks, and makes no change
    besides that `option` lacks: `option` then only recomputes more or adds changes."""
    fewer, more = kept.change.get(CHECKPOINTED_LAYERS), option.change.get(CHECKPOINTED_LAYERS)
    if kept.gpus != option.gpus or not (fewer and more and fewer <= more):
        return False
    others = ({repr(i) for i in o.change.items() if i[0] != CHECKPOINTED_LAYERS} for o in (kept, option))
    return next(others) <= next(others)


def auto_option(options: tuple[Option, ...], gpus: int) -> Option | None:
    """What train.fit: auto applies: the fastest option that fits on the same ranks and trains the same run."""
    return next((o for o in options if o.fits and o.gpus == gpus and not o.changes_training), None)
