"""TransformerEngine (TE) glue shared by the TE backends; TE itself is an optional extra.

Nothing here imports TE at module load: a machine without it imports the engine fine and gets a
BackendError naming the pip extra only when a TE backend actually runs.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util

import torch

from workbench.errors import INSTALL_HINT, BackendError


def _share_torch_cudnn() -> None:
    """Point TransformerEngine at the cuDNN torch bundles before TE loads one of its own.

    TE dlopens `libcudnn.so` from the system path first. Where the system cuDNN is another version
    than torch's wheel (the H200 image: 9.14 in /lib vs torch's 9.19), the process ends up with two
    half-loaded cuDNNs: TE's import fails with an undefined `cudnn::backend` symbol, or, imported
    first, it makes torch refuse cuDNN ("compiled against 9.19 but found 9.14"). Loading torch's
    own cuDNN libraries first, and naming their folder in CUDNN_HOME (where TE looks first), gives
    both one cuDNN. A CUDNN_HOME/CUDNN_PATH the user set is left alone.
    """
    import ctypes
    import glob
    import os

    if os.environ.get("CUDNN_HOME") or os.environ.get("CUDNN_PATH"):
        return
    try:
        import nvidia.cudnn as bundled  # the nvidia-cudnn wheel CUDA builds of torch depend on
    except ImportError:
        return
    for root in bundled.__path__:
        libs = sorted(glob.glob(os.path.join(root, "lib", "libcudnn*.so.*")), key=lambda p: ("graph" not in p, p))
        if not libs:
            continue
        for lib in libs:  # libcudnn_graph first: the others resolve symbols against it
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        os.environ["CUDNN_HOME"] = root  # TE's library search reads it (process-wide by design)
        return


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def import_transformer_engine():
    """`transformer_engine.pytorch`, loaded against torch's own cuDNN (see `_share_torch_cudnn`)."""
    import sys

    if "transformer_engine.pytorch" not in sys.modules and _has_module("transformer_engine"):
        try:
            _share_torch_cudnn()
        except OSError:
            pass  # a partial wheel: TE's own search then decides, and its error is reported
    return importlib.import_module("transformer_engine.pytorch")


def import_te(field: str):
    """`transformer_engine.pytorch`, or a BackendError naming the pip extra."""
    try:
        te = import_transformer_engine()
    except Exception as err:  # ImportError, or a broken install (missing CUDA libraries, ABI mismatch)
        raise BackendError(
            f"{field}='te' needs transformer_engine: {INSTALL_HINT['te']} (import failed: {type(err).__name__}: {err})"
        ) from err
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
