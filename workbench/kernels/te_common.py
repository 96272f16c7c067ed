"""TransformerEngine (TE) glue shared by the TE backends; TE itself is an optional extra.

Nothing here imports TE at module load: a machine without it imports the engine fine and gets a
BackendError naming the pip extra only when a TE backend actually runs.
"""

from __future__ import annotations

import contextlib

import torch

from workbench.backends import INSTALL_HINT, BackendError


def import_te(field: str):
    """`transformer_engine.pytorch`, or a BackendError naming the pip extra."""
    from workbench.backends import import_transformer_engine

    try:
        te = import_transformer_engine()
    except Exception as err:  # ImportError, or a broken install (missing CUDA libraries, ABI mismatch)
        raise BackendError(f"{field}='te' needs transformer_engine: {INSTALL_HINT['te']} "
                           f"(import failed: {type(err).__name__}: {err})") from err
    return te


def on_te_device(x: torch.Tensor) -> bool:
    """Whether TE kernels can take `x` (CUDA tensors only)."""
    return x.device.type == "cuda"


def check_cuda(field: str, x: torch.Tensor) -> None:
    """TE kernels run on CUDA tensors only; say which backend to use otherwise."""
    if not on_te_device(x):
        raise BackendError(f"{field}='te' needs CUDA tensors, got {x.device}; use {field}='auto'")


def fp8_autocast(enabled: bool):
    """TE's FP8 region for the forward (backward reuses the quantizers the forward saved).

    Float8CurrentScaling, not DelayedScaling: current scaling keeps no amax history, so (1) the
    state dict stays exactly Transformers' (TE keeps delayed-scaling history in `_extra_state`,
    which the engine leaves out to keep checkpoints loadable by vanilla Transformers/vLLM), and
    (2) the experts' GroupedLinear shell, shared by every layer of one shape, carries no
    per-layer scaling state.
    """
    if not enabled:
        return contextlib.nullcontext()
    te = import_te("fp8")
    from transformer_engine.common.recipe import Float8CurrentScaling, Format

    # HYBRID: E4M3 forward (activations, weights), E5M2 gradients (wider range), TE's default.
    return te.autocast(enabled=True, recipe=Float8CurrentScaling(fp8_format=Format.HYBRID))


def fp8_active() -> bool:
    """Whether a TE FP8 autocast region is active (never imports TE when it is absent)."""
    import sys

    if "transformer_engine.pytorch" not in sys.modules:
        return False
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    return FP8GlobalStateManager.is_fp8_enabled()
