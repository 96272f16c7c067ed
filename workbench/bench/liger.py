"""The anchor_liger row: Liger kernels on the vanilla Transformers model, confined to that row.

liger-kernel's per-family apply function patches the model instance (RMSNorm modules, the experts'
forward, the fused linear cross-entropy forward) and also the family's modeling module (its RoPE
function and module classes), which every later Transformers model of that family, the engine's
generic path included, would pick up. `liger_patched` restores those modules when the row ends.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from workbench.errors import INSTALL_HINT

# Module namespaces the apply functions write to (the model's modeling module; the loss utilities).
_PATCHED_PREFIX = "transformers."
_MISSING = object()


def liger_refusal(hf_config: Any) -> str | None:
    """Why the Liger anchor cannot run for this model here (package absent, family unknown to it); None if it can."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as err:
        return f"liger-kernel is not installed ({err}): {INSTALL_HINT['liger']}"
    except Exception as err:  # noqa: BLE001 - e.g. a liger-kernel built for another Transformers: a skip, not a crash
        return f"liger-kernel does not import with this Transformers ({type(err).__name__}: {err})"
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger-kernel has no kernels for model_type {model_type!r}"
    return None


def _snapshot() -> dict[str, dict[str, Any]]:
    return {
        name: dict(vars(mod))
        for name, mod in list(sys.modules.items())
        if mod is not None and name.startswith(_PATCHED_PREFIX)
    }


def _restore(saved: dict[str, dict[str, Any]]) -> None:
    # Names added meanwhile stay (submodules imported during the row, lazy-import caches): only what
    # the apply function replaced matters to later rows.
    for name, before in saved.items():
        mod = sys.modules.get(name)
        if mod is None:
            continue
        now = vars(mod)
        for key, value in before.items():
            if now.get(key, _MISSING) is not value:
                setattr(mod, key, value)


@contextlib.contextmanager
def liger_patched(model: torch.nn.Module) -> Iterator[dict[str, Any]]:
    """Apply liger-kernel's kernels for the model's family to `model`; Transformers' modules restored on exit.

    Yields what was applied (for the row's setup). The family's defaults: RoPE, RMSNorm, fused
    linear cross-entropy and SwiGLU/experts, where liger-kernel has them for the family.
    """
    import inspect

    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN, _apply_liger_kernel_to_instance

    model_type = model.config.model_type
    fn = MODEL_TYPE_TO_APPLY_LIGER_FN[model_type]
    applied = {
        k: p.default
        for k, p in inspect.signature(fn).parameters.items()
        if k != "model" and isinstance(p.default, bool)
    }
    saved = _snapshot()
    try:
        _apply_liger_kernel_to_instance(model)
        yield {"liger_kernel": _liger_version(), "liger_apply": fn.__name__, "liger_kernels": applied}
    finally:
        _restore(saved)


def _liger_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("liger-kernel")
    except metadata.PackageNotFoundError:
        return None
