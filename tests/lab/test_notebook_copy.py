"""Where the launcher's cards copy the workbench notebooks: the user's notebooks folder (beside the runs
folder, or c.MoeWorkbenchLab.notebooks_dir), never the server's root as such and never the repository
checkout; and what a card is labelled."""

from __future__ import annotations

import json

import pytest
import tornado.httpclient

pytest.importorskip("moe_workbench_lab", reason="install it: pip install -e extensions/moe_workbench_lab")
from moe_workbench_lab.notebooks import list_notebooks, plain_title, repository_checkout

pytest.importorskip("pytest_jupyter", reason="install it: pip install 'pytest-jupyter[server]'")
pytest_plugins = ["pytest_jupyter.jupyter_server"]

NAME = "01_quickstart.ipynb"


@pytest.fixture
def notebooks_dir(tmp_path, monkeypatch):
    source = tmp_path / "nb-source"
    source.mkdir()
    nb = {
        "cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# Quickstart\n"]}],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (source / NAME).write_text(json.dumps(nb))
    monkeypatch.setenv("WORKBENCH_NOTEBOOKS_DIR", str(source))
    return source


async def _copy(jp_fetch) -> dict:
    response = await jp_fetch("moe-workbench", "api", "notebooks", NAME, method="POST", body=b"")
    return json.loads(response.body)


async def test_the_copy_goes_beside_the_runs_folder_not_into_the_root(
    jp_fetch, jp_root_dir, notebooks_dir, user_notebooks
):
    answer = await _copy(jp_fetch)
    assert answer["path"] == f"moe-workbench/notebooks/{NAME}" and answer["copied"] is True
    assert (user_notebooks / NAME).is_file()
    assert not (jp_root_dir / NAME).exists()  # the server's root itself (a checkout, say) gets nothing
    assert sorted(p.name for p in jp_root_dir.iterdir()) == ["moe-workbench"]


async def test_a_runs_folder_outside_the_root_gets_the_copy_and_says_how_to_open_it(
    jp_fetch, jp_root_dir, notebooks_dir, tmp_path, monkeypatch
):
    home = tmp_path / "home" / "moe-workbench"
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(home / "runs"))
    answer = await _copy(jp_fetch)
    assert answer["path"] is None and answer["file"] == str(home / "notebooks" / NAME)
    assert (home / "notebooks" / NAME).is_file()
    assert f"jupyter lab --notebook-dir {home}" in answer["note"]
    assert list(jp_root_dir.iterdir()) == []


async def test_a_folder_in_the_repository_checkout_is_refused_unwritten(jp_fetch, notebooks_dir, monkeypatch):
    checkout = repository_checkout()
    assert checkout is not None, "the tests run from a source checkout (pip install -e .)"
    planned = checkout / "mwb-test-never-created"
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(planned / "runs"))
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await _copy(jp_fetch)
    assert info.value.code == 409
    message = json.loads(info.value.response.body)["message"]
    assert "repository checkout" in message and "c.MoeWorkbenchLab.notebooks_dir" in message
    assert not planned.exists()


class TestConfiguredFolder:
    """c.MoeWorkbenchLab.notebooks_dir names the folder (the user's chosen workspace)."""

    @pytest.fixture
    def configured_notebooks_dir(self, tmp_path):
        return tmp_path / "my-workspace" / "notebooks"

    @pytest.fixture
    def jp_server_config(self, configured_notebooks_dir):
        return {
            "ServerApp": {"jpserver_extensions": {"moe_workbench_lab": True}},
            "MoeWorkbenchLab": {"notebooks_dir": str(configured_notebooks_dir)},
        }

    async def test_the_configured_notebooks_dir_is_used(
        self, jp_fetch, notebooks_dir, configured_notebooks_dir, user_notebooks
    ):
        answer = await _copy(jp_fetch)
        assert answer["file"] == str(configured_notebooks_dir / NAME) and (configured_notebooks_dir / NAME).is_file()
        assert not user_notebooks.exists()


def test_card_labels_show_no_markdown_marks(monkeypatch):
    assert (
        plain_title("06 · Your data: a `datasets` dataset, **eval** loss")
        == "06 · Your data: a datasets dataset, eval loss"
    )
    assert plain_title("snake_case_name and 2 * 3") == "snake_case_name and 2 * 3"
    monkeypatch.delenv("WORKBENCH_NOTEBOOKS_DIR", raising=False)
    titles = [nb["title"] for nb in list_notebooks()["notebooks"]]
    assert titles and not [t for t in titles if "`" in t or "**" in t], titles
