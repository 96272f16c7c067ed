"""pytest plugin of benchmarks/suites/cuda_tests.sh: keeps only the tests that exist for a CUDA GPU.

A test is kept when its name or parameters name CUDA or a GPU (the `[cuda]` case of tests/triton_script.py's scripts,
`test_..._on_cuda_...`), or when a skipif mark on it gives a reason that names CUDA or a GPU: the tests a CPU machine
skips for want of one. Load it with `-p cuda_only`, this folder on PYTHONPATH.
"""

from __future__ import annotations

import re

import pytest

NAMES_CUDA = re.compile(r"cuda|gpu", re.IGNORECASE)


def for_cuda(item: pytest.Item) -> bool:
    """Whether `item` is one of the tests a CPU machine cannot run in full."""
    if NAMES_CUDA.search(item.nodeid.split("::", 1)[-1]):
        return True
    return any(NAMES_CUDA.search(str(mark.kwargs.get("reason", ""))) for mark in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept = [item for item in items if for_cuda(item)]
    config.hook.pytest_deselected(items=[item for item in items if not for_cuda(item)])
    items[:] = kept
