"""The engine variants' backends: the launch's BackendConfig with each variant's gate and overrides."""

from __future__ import annotations

import dataclasses

from workbench.backends import BackendConfig
from workbench.bench.config import VariantSpec


def variant_backend(spec: VariantSpec, backend: BackendConfig) -> BackendConfig:
    """The launch's engine backends with this variant's gate and overrides applied."""
    return dataclasses.replace(backend, gate=spec.gate, **dict(spec.backend))
