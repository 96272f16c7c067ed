"""The fused cross-entropy on the model's side: which models can take it, the deferred lm_head, the output.

BackendConfig.fused_ce computes the lm_head and the cross-entropy together, a chunk of tokens at a time
(kernels/cross_entropy.py), so the [tokens, vocab] logits are never built. That equals Transformers' loss only
where the logits are lm_head(hidden) and nothing more: a family that scales or softcaps them, or a head with a bias
or of another type, cannot take it. fused_ce='auto' (the default) is on wherever that holds and off elsewhere, with
the reason; fused_ce=True there is refused.

A forward given labels under the fused CE returns no logits: its `logits` are NOT_COMPUTED, whose every use raises
LogitsNotComputedError, which says how to get them (`return_logits=True` for that call, a forward without labels, or
fused_ce=False).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
from torch import nn

from workbench.kernels.cross_entropy import fused_linear_cross_entropy
from workbench.kernels.cross_entropy import shift_labels as shifted
from workbench.models.meta_model import meta_model

log = logging.getLogger(__name__)

# Config fields that transform logits between lm_head and the loss (their families cannot fuse CE): a softcap where
# it is set, a scale wherever the config has one (GraniteMoE's forward divides by logits_scaling even when it is 1.0,
# which makes a new tensor the loss cannot take as the hidden states).
LOGIT_SOFTCAPS = ("final_logit_softcapping", "logit_softcapping")
LOGIT_SCALES = ("logits_scaling", "logit_scale")

NO_LOGITS = (
    "logits were not computed: with labels, BackendConfig.fused_ce computes the loss from the hidden states a "
    "chunk at a time without the [tokens, vocab] logits. To get them pass return_logits=True to this call "
    "(the loss is then computed from full logits), call the model without labels, or build it with "
    "BackendConfig(fused_ce=False)"
)


class DeferredLMHead(nn.Linear):
    """The lm_head; while the fused cross-entropy runs it hands the hidden states on unchanged."""

    defer_to_loss: bool = False  # inside a fused loss forward (deferred_logits)
    deferred_hidden = None  # what it handed on, which the loss checks it gets back

    def forward(self, hidden):
        """F.linear, or (inside the fused loss forward) the hidden states themselves."""
        if not self.defer_to_loss:
            return super().forward(hidden)
        self.deferred_hidden = hidden
        return hidden


def fused_ce_refusal(model: nn.Module) -> str | None:
    """Why `model`'s logits are more than lm_head(hidden), so its loss cannot be the fused CE; None where it can."""
    head = model.get_output_embeddings()
    if type(head) not in (nn.Linear, DeferredLMHead):
        return f"its output embedding is a {type(head).__name__}, not an nn.Linear"
    if head.bias is not None:
        return "its lm_head has a bias"
    for field in LOGIT_SOFTCAPS + LOGIT_SCALES:
        value = getattr(model.config, field, None)
        if value is not None and (field in LOGIT_SCALES or value not in (0, 0.0)):
            return f"its config sets {field}={value} (logits are transformed before the loss)"
    return None


# (config class, its JSON) -> fused_ce_support's answer: a meta build per distinct config, not per question
_SUPPORT: dict[tuple[type, str], tuple[bool, str]] = {}


def fused_ce_support(config) -> tuple[bool, str]:
    """(whether the model of Transformers `config` can take the fused CE, why not): what fused_ce='auto' becomes.

    Asked of its meta model (no memory, no init), once per distinct config; `BackendConfig.resolve(...,
    fused_ce_support=fused_ce_support(config))` decides fused_ce with it before anything is built.
    """
    key = (type(config), config.to_json_string(use_diff=False))
    if key not in _SUPPORT:
        refusal = fused_ce_refusal(meta_model(config))
        _SUPPORT[key] = (refusal is None, refusal or "")
    return _SUPPORT[key]


def say_fused_ce_off(model_type: str, why: str) -> None:
    """Say where fused_ce='auto' was decided off, and why (the step then builds the full logits)."""
    log.warning("fused_ce='auto' is off for model_type %r: %s; its loss builds the full logits", model_type, why)


def resolve_for_config(backend, device, world_size: int, config):
    """`backend.resolve(device, world_size)` with fused_ce decided for the model of Transformers `config` (an 'auto'
    that is off says why): what a run records before its model is built."""
    support = fused_ce_support(config)
    resolved = backend.resolve(device, world_size=world_size, fused_ce_support=support)
    if backend.fused_ce == "auto" and not support[0]:
        say_fused_ce_off(config.model_type, support[1])
    return resolved


def fused_ce_for_model(backend, model: nn.Module):
    """`backend` (resolved) with fused_ce decided for the built `model`: 'auto' on where it can take the fused CE,
    off (the reason logged) where not; fused_ce=True where it cannot is refused (ValueError)."""
    refusal = fused_ce_refusal(model)
    if backend.fused_ce is True and refusal is not None:
        raise ValueError(
            f"BackendConfig.fused_ce=True cannot serve model_type {model.config.model_type!r}: {refusal}; "
            "set fused_ce='auto' (on wherever the model allows it) or False"
        )
    if backend.fused_ce != "auto":
        return backend
    if refusal is not None:
        say_fused_ce_off(model.config.model_type, refusal)
    return dataclasses.replace(backend, fused_ce=refusal is None)


def handed_back(logits: torch.Tensor, hidden: torch.Tensor) -> bool:
    """Whether the loss got back the hidden states the lm_head handed on: the same tensor, or only cast to float32.

    Nemotron-H's forward calls `.float()` on its logits before the loss; the fused CE computes in float32 anyway, so
    it takes the hidden states as they left the lm_head. Anything else (a scale, a softcap) is a change it refuses.
    """
    if logits is hidden:
        return True
    if logits.dtype != torch.float32 or logits.shape != hidden.shape:
        return False
    cast = logits.grad_fn
    if cast is not None:  # training: the cast is the one node between them
        return type(cast).__name__ == "ToCopyBackward0" and cast.next_functions[0][0] is hidden.grad_fn
    return torch.equal(logits, hidden.float())  # no autograd graph to read (a forward under no_grad)


def _fused_loss(head: DeferredLMHead, use_triton: bool):
    def loss(logits, labels, vocab_size=None, num_items_in_batch=None, ignore_index=-100, shift_labels=None, **kwargs):
        if not handed_back(logits, head.deferred_hidden):
            raise RuntimeError(
                "fused_ce: the model changed the logits between lm_head and its loss; this family "
                "cannot use BackendConfig.fused_ce=True; set fused_ce=False"
            )
        logits = head.deferred_hidden
        targets = shifted(labels, ignore_index) if shift_labels is None else shift_labels
        return fused_linear_cross_entropy(
            logits,
            head.weight,
            targets.to(logits.device),
            ignore_index=ignore_index,
            num_items_in_batch=num_items_in_batch,
            use_triton=use_triton,
        )

    return loss


@contextlib.contextmanager
def deferred_logits(model: nn.Module, use_triton: bool):
    """Inside: the lm_head hands the hidden states to the model's loss, which is the fused CE."""
    head = model.get_output_embeddings()
    had_own = "_loss_function" in vars(model)
    own = vars(model).get("_loss_function")
    head.defer_to_loss = True
    model.loss_function = _fused_loss(head, use_triton)
    try:
        yield
    finally:
        head.defer_to_loss = False
        head.deferred_hidden = None
        if had_own:
            model.loss_function = own
        else:
            del model._loss_function


class LogitsNotComputedError(AttributeError):
    """Raised on using the logits of a forward whose loss was the fused CE. An AttributeError, so that probes such
    as `getattr(logits, "__deepcopy__", None)` (copy, pickle, torch) answer as for any object without the attribute."""


def _refuse(*_args, **_kwargs):
    raise LogitsNotComputedError(NO_LOGITS)


class NotComputedLogits:
    """What stands in an output's `logits` where the fused CE built none: any use raises LogitsNotComputedError,
    which says how to get them, at the line that uses them (a None would fail far away, or be taken for "no logits").

    A value, not a missing field: code that walks an output's fields (FSDP2's forward hooks, dataclass repr,
    pickling) passes it by as it passes any non-tensor.
    """

    __slots__ = ()

    def __getattr__(self, name: str):
        raise LogitsNotComputedError(NO_LOGITS)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise LogitsNotComputedError(NO_LOGITS)

    __getitem__ = __iter__ = __len__ = __bool__ = __float__ = __array__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __matmul__ = __neg__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse  # == stays identity: `x in (None, ...)` must not raise

    def __repr__(self) -> str:
        return "<logits not computed: fused_ce; pass return_logits=True for them>"

    def __reduce__(self):
        return (_not_computed, ())


def _not_computed() -> NotComputedLogits:
    return NOT_COMPUTED


NOT_COMPUTED = NotComputedLogits()


def without_logits(out):
    """`out` whose logits are NOT_COMPUTED: the lm_head handed on hidden states, which are not logits."""
    out["logits"] = NOT_COMPUTED  # the item and the attribute (ModelOutput sets both)
    return out
