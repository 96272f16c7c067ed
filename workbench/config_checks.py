"""ConfigError and the value checks every RunConfig section runs in __post_init__."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


class ConfigError(ValueError):
    """A RunConfig (or one of its sections) that cannot describe a valid run."""


def check_keys(cls: type, data: Any, where: str) -> None:
    """Refuse a non-mapping or a key that is not a field of dataclass `cls`, naming `where`."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a mapping, got {type(data).__name__} {data!r}")
    allowed = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in data if k not in allowed]
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {where}; allowed keys: {allowed}")


def check_int(value: Any, name: str, minimum: int, allow_none: bool = False) -> None:
    """Refuse anything but an int >= `minimum` (a bool is not one); None too unless `allow_none`."""
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def check_float(value: Any, name: str, lo: float, hi: float | None = None) -> None:
    """Refuse anything but a finite number in [lo, hi] (hi None: no upper bound)."""
    # math.isfinite first: nan compares False with every bound, so `value < lo` alone lets it through
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < lo
        or (hi is not None and value > hi)
    ):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ConfigError(f"{name} must be a finite number {bound}, got {value!r}")
