"""The lab writes nothing through a link: the notebook copy refuses a link in the user's notebooks folder."""

from __future__ import annotations

import json

import pytest
import tornado.httpclient

pytest.importorskip("moe_workbench_lab", reason="install it: pip install -e extensions/moe_workbench_lab")
pytest.importorskip("pytest_jupyter", reason="install it: pip install 'pytest-jupyter[server]'")
pytest_plugins = ["pytest_jupyter.jupyter_server"]

NAME = "01_quickstart.ipynb"


@pytest.fixture
def notebooks_dir(tmp_path, monkeypatch):
    source = tmp_path / "nb-source"
    source.mkdir()
    nb = {
        "cells": [{"cell_type": "markdown", "id": "intro", "metadata": {}, "source": ["# Quickstart\n"]}],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (source / NAME).write_text(json.dumps(nb))
    monkeypatch.setenv("WORKBENCH_NOTEBOOKS_DIR", str(source))
    return source


async def _copy(jp_fetch):
    return await jp_fetch("moe-workbench", "api", "notebooks", NAME, method="POST", body=b"")


async def test_a_dangling_link_in_the_notebooks_folder_is_not_written_through(
    jp_fetch, user_notebooks, notebooks_dir, tmp_path
):
    outside = tmp_path / "outside"
    outside.mkdir()
    user_notebooks.mkdir(parents=True)
    (user_notebooks / NAME).symlink_to(outside / "planted.ipynb")  # dangling: its target does not exist yet
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await _copy(jp_fetch)
    assert info.value.code == 403
    body = json.loads(info.value.response.body)
    assert "link" in body["message"] and NAME in body["message"], body
    assert list(outside.iterdir()) == []  # nothing was created where the link points
    assert (user_notebooks / NAME).is_symlink()


async def test_a_link_to_an_existing_file_outside_is_refused_and_left_alone(
    jp_fetch, user_notebooks, notebooks_dir, tmp_path
):
    target = tmp_path / "elsewhere.ipynb"
    target.write_text("not a notebook: the user's own file")
    user_notebooks.mkdir(parents=True)
    (user_notebooks / NAME).symlink_to(target)
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await _copy(jp_fetch)
    assert info.value.code == 403
    assert target.read_text() == "not a notebook: the user's own file"


async def test_a_linked_notebooks_folder_is_not_written_through(jp_fetch, user_notebooks, notebooks_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    user_notebooks.parent.mkdir(parents=True)
    user_notebooks.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await _copy(jp_fetch)
    assert info.value.code == 403 and "link" in json.loads(info.value.response.body)["message"]
    assert list(elsewhere.iterdir()) == []


async def test_a_plain_folder_still_gets_its_copy(jp_fetch, user_notebooks, notebooks_dir):
    response = await _copy(jp_fetch)
    assert json.loads(response.body)["copied"] is True
    assert not (user_notebooks / NAME).is_symlink()
    assert json.loads((user_notebooks / NAME).read_text())["nbformat"] == 4
