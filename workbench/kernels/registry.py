"""KernelRegistry: one kernel's implementations by backend name, read-only.

The backend name comes from a resolved BackendConfig (workbench.backends decides what runs where);
a registry only maps that name to the function, so kernels never look at the machine or a config.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from types import MappingProxyType

from workbench.errors import BackendError


class KernelRegistry(Mapping[str, Callable]):
    """`{backend name: implementation}` of one kernel; `impl(name)` refuses an unknown name, listing the known."""

    def __init__(self, kernel: str, impls: Mapping[str, Callable]) -> None:
        if not impls or not all(callable(f) for f in impls.values()):
            raise TypeError(f"KernelRegistry {kernel!r} needs at least one implementation, all callables")
        self.kernel = kernel
        self._impls = MappingProxyType(dict(impls))

    def impl(self, backend: str) -> Callable:
        """The implementation for `backend` (a resolved BackendConfig field: never "auto")."""
        try:
            return self._impls[backend]
        except (KeyError, TypeError):
            raise BackendError(
                f"unknown {self.kernel} backend {backend!r}; choose one of {list(self._impls)} "
                "(BackendConfig.resolve turns 'auto' into one of them)"
            ) from None

    def __getitem__(self, backend: str) -> Callable:
        return self._impls[backend]

    def __iter__(self) -> Iterator[str]:
        return iter(self._impls)

    def __len__(self) -> int:
        return len(self._impls)

    def __repr__(self) -> str:
        return f"KernelRegistry({self.kernel!r}, {list(self._impls)})"
