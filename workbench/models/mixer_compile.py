"""How the engine's sequence mixers run their math: compiled by torch.compile on CUDA, eager elsewhere.

The mixers' math is plain torch (kernels/ssd_scan.py, kernels/gated_delta.py, kernels/causal_conv.py) rather than
hand-written Triton: inductor turns it into Triton kernels generated for the Triton that ships with the user's torch
(flash-linear-attention's hand-written Gated DeltaNet kernels refuse Hopper with Triton 3.4 - 3.7.0, where they give
wrong gradients), and autograd derives the backward, which the tests compare with Transformers' own torch path.
One compile per function and input shape (dynamic=False: every layer of a model shares it); on the CPU the same
functions run eagerly (the tests' path). A function whose forward cannot be compiled here (dynamo or inductor raises at
its first call) runs eagerly from then on, with one warning: the same math, slower. A failure in compiling the
backward (at the first backward) is not caught: it is raised as it comes.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
from torch._dynamo.exc import TorchDynamoException
from torch._inductor.exc import InductorError

logger = logging.getLogger(__name__)

# What torch.compile raises when it cannot build a function here (as opposed to an error of the math itself).
COMPILE_ERRORS = (TorchDynamoException, InductorError)


@functools.cache
def _compiled(fn: Callable) -> Callable:
    return torch.compile(fn, dynamic=False, fullgraph=True)


# The functions whose compile failed in this process: they run eagerly.
_COMPILE_FAILED: set[Callable] = set()


def _compiled_or_eager(fn: Callable) -> Callable:
    compiled = _compiled(fn)

    def call(*args, **kwargs):
        if fn not in _COMPILE_FAILED:
            try:
                return compiled(*args, **kwargs)
            except COMPILE_ERRORS as err:
                _COMPILE_FAILED.add(fn)
                logger.warning(
                    "torch.compile could not build the mixer function %s here (%s: %s); it runs eagerly from now on "
                    "(the same math, slower)",
                    fn.__name__,
                    type(err).__name__,
                    str(err).splitlines()[0][:200] if str(err) else "",
                )
        return fn(*args, **kwargs)

    return call


def mixer_math(fn: Callable, device: torch.device) -> Callable:
    """`fn` as it runs on `device`: compiled (once per input shape) on CUDA, itself on any other device."""
    if device.type != "cuda" or fn in _COMPILE_FAILED:
        return fn
    return _compiled_or_eager(fn)


def run_mixer_math(fn: Callable, device: torch.device, *args, **kwargs):
    """`fn(*args, **kwargs)` as it runs on `device` (mixer_math)."""
    return mixer_math(fn, device)(*args, **kwargs)
