"""Fixtures for the lab extension's server tests.

The run directory comes from make_run.make_run_dir: a copy of one real `workbench demo` run.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from make_run import make_run_dir


@pytest.fixture
def workbench_run(tmp_path) -> tuple[Path, str]:
    return make_run_dir(tmp_path)


@pytest.fixture
def served_run(workbench_run, monkeypatch) -> tuple[Path, str]:
    """The demo run copy in the folder the server serves ($WORKBENCH_RUNS_DIR)."""
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(workbench_run[0]))
    return workbench_run


@pytest.fixture
def user_notebooks(jp_root_dir, monkeypatch) -> Path:
    """The runs folder in the server's root (root/moe-workbench/runs); returns the folder the launcher copies
    notebooks into (notebooks/ beside it), so no test writes to ~/moe-workbench."""
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(jp_root_dir / "moe-workbench" / "runs"))
    return jp_root_dir / "moe-workbench" / "notebooks"


@pytest.fixture
def jp_server_config():
    """Enable our server extension on the pytest-jupyter test server."""
    return {"ServerApp": {"jpserver_extensions": {"moe_workbench_lab": True}}}
