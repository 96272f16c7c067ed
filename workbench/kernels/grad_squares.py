"""Gradients whose sum of squares the kernel that wrote them already took: the clipping norm need not read them.

A kernel that writes a parameter's whole gradient (the grouped weight gradient, kernels/grouped_wgrad.py) can sum
its squares on the way out. `record` notes them on the parameter together with the gradient's storage (a weak
reference: nothing is kept alive), address, shape and version; `take` hands them back only while the parameter's
`.grad` is still that very tensor, unchanged. Autograd accumulating into an earlier gradient, an in-place change (a
reduction, a scaling), a copy, or a gradient written since: `take` gives None, and the norm reads the gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.multiprocessing.reductions import StorageWeakRef

ATTR = "workbench_grad_squares"


@dataclass(frozen=True)
class _Squares:
    storage: StorageWeakRef
    ptr: int
    shape: torch.Size
    version: int
    partials: torch.Tensor  # float32 partial sums of Σ grad², added in a fixed order


def record(param: torch.Tensor, grad: torch.Tensor, partials: torch.Tensor) -> None:
    """Note that `partials` (float32) sum to Σ grad² for the gradient `grad` autograd is about to hand `param`."""
    squares = _Squares(StorageWeakRef(grad.untyped_storage()), grad.data_ptr(), grad.shape, grad._version, partials)
    setattr(param, ATTR, squares)


def take(param: torch.Tensor) -> torch.Tensor | None:
    """Σ param.grad² (a float32 device scalar) where a recorded kernel's sum still describes .grad; else None.

    The record goes either way: one backward's sums serve one norm.
    """
    squares = getattr(param, ATTR, None)
    if squares is None:
        return None
    delattr(param, ATTR)
    grad = param.grad
    if (
        type(grad) is not torch.Tensor
        or squares.storage.expired()
        or grad.data_ptr() != squares.ptr
        or grad.shape != squares.shape
        or grad._version != squares.version
    ):
        return None
    return squares.partials.sum()
