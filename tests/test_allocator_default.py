"""`import workbench` turns on CUDA's expandable segments unless the user configured the allocator."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = "import os, workbench; print(os.environ.get('PYTORCH_ALLOC_CONF'), os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"


def _probe(**env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**base, **env}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_expandable_segments_by_default():
    assert _probe() == "expandable_segments:True None"


@pytest.mark.parametrize(
    "env, seen",
    [
        ({"PYTORCH_ALLOC_CONF": "expandable_segments:False"}, "expandable_segments:False None"),
        ({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}, "None max_split_size_mb:512"),
    ],
)
def test_a_users_allocator_setting_is_kept(env, seen):
    assert _probe(**env) == seen
