"""The non-finite guard: a step whose loss or gradient norm is NaN/inf never reaches the weights.

The values are reduced over all ranks, so every rank takes the same decision and raises together
(no rank is left waiting in a collective). The trainer decides on the device (a sticky flag the
optimizer reads: workbench.train.step_stats.SkipFlag) and raises when it reads the step back, with
`non_finite_error`; for an optimizer that cannot skip on the device it calls `check_finite` before
`optimizer.step()`. Nothing is saved for the failing step or after it: the latest checkpoint stays
the last good one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class NonFiniteError(FloatingPointError):
    """A loss, aux loss or gradient norm that is NaN or infinite; the step was not applied."""


@dataclass(frozen=True)
class StepValues:
    """What the guard looks at for one step, the same on every rank."""

    step: int
    first_step: bool  # the first step of this run (or of this resume)
    resumed_from: str | None
    ce_loss: float  # global cross-entropy
    aux_loss: float  # global router aux loss (0 for a model without one)
    aux_coef: float
    grad_norm: float
    grad_norm_finite: bool  # on every rank
    lr: float  # the scheduled lr of this step
    train_lr: float
    clip_grad_norm: float | None


def _lr_advice(v: StepValues) -> str:
    clip = (
        f"lower train.clip_grad_norm (now {v.clip_grad_norm})"
        if v.clip_grad_norm is not None
        else "enable train.clip_grad_norm (e.g. 1.0; now off)"
    )
    return f"lower train.lr (now {v.train_lr:g}; this step's lr {v.lr:g}) or {clip}"


def check_finite(v: StepValues) -> None:
    """Raise NonFiniteError naming the step, the quantity and what to change; else return."""
    applied = (
        f" The weights were not updated and no checkpoint is written for step {v.step}: the latest "
        "checkpoint (if any) is the last good step."
    )
    aux_term = v.aux_coef * v.aux_loss
    if not math.isfinite(aux_term):
        if math.isfinite(v.aux_loss):
            advice = f"model.router_aux_loss_coef is {v.aux_coef}: set a finite value (e.g. 0.001) or 0"
        elif v.first_step:
            advice = (
                f"the router's aux loss is non-finite before any update: lower or zero "
                f"model.router_aux_loss_coef (now {v.aux_coef:g}), check the data and model.dtype"
            )
        else:
            advice = f"lower or zero model.router_aux_loss_coef (now {v.aux_coef:g}), or {_lr_advice(v)}"
        raise NonFiniteError(
            f"step {v.step}: the router aux loss term is {aux_term} (router_aux_loss_coef "
            f"{v.aux_coef:g} x aux loss {v.aux_loss}); {advice}.{applied}"
        )
    if not math.isfinite(v.ce_loss):
        if v.first_step and v.resumed_from:
            advice = (
                f"this is the first step after resuming from {v.resumed_from}: the checkpoint's weights "
                "or this step's data give a non-finite loss; resume from an earlier checkpoint or check "
                "the data"
            )
        elif v.first_step:
            advice = (
                "this is the first step, before any update: check the data (token ids inside the "
                "model's vocabulary, labels) and the model's initialization or dtype (model.dtype; "
                "float32 overflows least)"
            )
        else:
            advice = f"earlier updates diverged: {_lr_advice(v)}"
        raise NonFiniteError(f"step {v.step}: the loss is {v.ce_loss}; {advice}.{applied}")
    if not v.grad_norm_finite:
        raise NonFiniteError(
            f"step {v.step}: the gradient norm is {v.grad_norm} while the loss "
            f"({v.ce_loss + aux_term:.4f}) is finite: the backward pass overflowed; "
            f"{_lr_advice(v)}.{applied}"
        )


def non_finite_error(v: StepValues) -> NonFiniteError:
    """The error `check_finite` raises for `v`, a step the device found non-finite."""
    try:
        check_finite(v)
    except NonFiniteError as err:
        return err
    # the device and the host test the same quantities: only a value that changed on its way here lands here
    return NonFiniteError(
        f"step {v.step}: the device found a non-finite loss, aux loss or gradient norm (read "
        f"back: loss {v.ce_loss}, aux loss {v.aux_loss}, gradient norm {v.grad_norm}); "
        f"{_lr_advice(v)}. The weights were not updated from step {v.step} on."
    )
