"""How the engine's sequence mixers run their math: compiled by torch.compile on CUDA, eager elsewhere.

The mixers' math is plain torch (kernels/ssd_scan.py, kernels/gated_delta.py, kernels/causal_conv.py) rather than
hand-written Triton: inductor turns it into Triton kernels generated for the Triton that ships with the user's torch
(flash-linear-attention's hand-written Gated DeltaNet kernels refuse Hopper with Triton 3.4 - 3.7.0, where they give
wrong gradients), and autograd derives the backward, which the tests compare with Transformers' own torch path.
One compile per function and input shape (dynamic=False: every layer of a model shares it); on the CPU the same
functions run eagerly (the tests' path).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False, fullgraph=True)


def mixer_math(fn: Callable, device: torch.device) -> Callable:
    """`fn` as it runs on `device`: compiled (once per input shape) on CUDA, itself on any other device."""
    return _compiled(fn) if device.type == "cuda" else fn


def run_mixer_math(fn: Callable, device: torch.device, *args, **kwargs):
    """`fn(*args, **kwargs)` as it runs on `device` (mixer_math)."""
    return mixer_math(fn, device)(*args, **kwargs)
