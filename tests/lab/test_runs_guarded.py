"""The runs routes on a real jupyter_server: confined to the served runs folder, metrics read incrementally.

Requests go out as raw paths (not through jp_fetch, which escapes them) so `..`, `%2e%2e` and `%2F`
reach the server exactly as an attacker would send them.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
from make_run import append_records as _append
from make_run import append_text as _append_raw
from make_run import trainer_records as _records

from workbench.runs.run_dir import RunDir
from workbench.runs.run_index import IndexLimits, RunIndex

pytest.importorskip("moe_workbench_lab", reason="install it: pip install -e extensions/moe_workbench_lab")
from moe_workbench_lab.handlers import RUN_INDEX_KEY

pytest.importorskip("pytest_jupyter", reason="install it: pip install 'pytest-jupyter[server]'")
pytest_plugins = ["pytest_jupyter.jupyter_server"]

OUTSIDE_RUN = "secret-run"


@pytest.fixture
def api(http_server_client, jp_auth_header, jp_base_url):
    """<method> <base>moe-workbench/api/<raw path, sent as written>: (HTTP code, answer)."""

    async def get(raw: str, method: str = "GET") -> tuple[int, dict]:
        response = await http_server_client.fetch(
            f"{jp_base_url}moe-workbench/api/{raw}",
            method=method,
            headers=jp_auth_header,
            body=b"" if method == "POST" else None,
            raise_error=False,
            request_timeout=20,
        )
        if response.headers.get("Content-Type", "").startswith("application/json"):
            return response.code, json.loads(response.body)
        return response.code, {"page": response.body.decode()}  # tornado's own 404 page

    return get


@pytest.fixture
def outside(tmp_path, served_run):
    """A run folder and a notebook outside every served folder: nothing here may be served."""
    runs_dir, run_id = served_run
    folder = tmp_path / "outside"
    shutil.copytree(runs_dir / run_id, folder / OUTSIDE_RUN)
    RunDir(folder / OUTSIDE_RUN).write_status("running", step=4242, secret="outside-status")
    return folder


@pytest.mark.parametrize(
    "query",
    [
        "/",
        "~",
        "..",
        "../../",
        "%2e%2e%2F%2e%2e",
        "%2Fetc",
        "{parent}",
        "{outside}",
        "{runs}/..",
        "{runs}/../outside",
        "{runs}-other",
    ],
)
async def test_runs_dir_query_names_only_the_served_folder(api, served_run, outside, query):
    runs_dir, _ = served_run
    value = query.format(parent=runs_dir.parent, outside=outside, runs=runs_dir)
    for route in ("runs", f"runs/{served_run[1]}/metrics"):
        code, answer = await api(f"{route}?runs_dir={value}")
        assert code == 403, (route, value, answer)
        assert "is not this server's runs directory" in answer["message"]
        assert str(runs_dir) in answer["message"] and "MoeWorkbenchLab.runs_dir" in answer["message"]


async def test_runs_dir_query_may_spell_the_served_folder_another_way(api, served_run, tmp_path, monkeypatch):
    runs_dir, run_id = served_run
    (tmp_path / "runs-link").symlink_to(runs_dir)
    for value in (runs_dir, f"{runs_dir}/", f"{runs_dir}/{run_id}/..", tmp_path / "runs-link"):
        code, answer = await api(f"runs?runs_dir={value}")
        assert code == 200 and [r["id"] for r in answer["runs"]] == [run_id]
    # The served folder may itself be a link (runs on another disk): what is inside its target is in.
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "runs-link"))
    code, answer = await api("runs")
    assert code == 200 and answer["runs_dir"] == str(tmp_path / "runs-link")
    assert [(r["id"], r["readable"]) for r in answer["runs"]] == [(run_id, True)]
    code, answer = await api(f"runs/{run_id}/metrics?runs_dir={runs_dir}")
    assert code == 200 and answer["records"]


@pytest.mark.parametrize(
    "field",
    [
        "spark_points",
        "max_bytes_per_poll",
        "max_line_bytes",
        "chunk_bytes",
        "series_points",
        "series_ranks",
        "series_runs",
    ],
)
@pytest.mark.parametrize("value", [0, 1, -5, 2.5, True])
def test_index_limits_are_validated(field, value):
    with pytest.raises(ValueError, match=f"IndexLimits.{field} must be an integer >= 2, got {value!r}"):
        IndexLimits(**{field: value})


async def test_links_out_of_the_runs_dir_are_not_followed(api, served_run, outside):
    runs_dir, run_id = served_run
    secret = outside / OUTSIDE_RUN
    (runs_dir / "linked-run").symlink_to(secret)  # a whole run folder that lives outside
    leaky = runs_dir / "leaky-metrics"  # a real run folder whose metrics file is a link out
    leaky.mkdir()
    shutil.copy(secret / "config.json", leaky / "config.json")
    (leaky / "metrics.jsonl").symlink_to(secret / "metrics.jsonl")
    leaky_status = runs_dir / "leaky-status"
    leaky_status.mkdir()
    (leaky_status / "status.json").symlink_to(secret / "status.json")
    fifo = runs_dir / "fifo-metrics"  # a FIFO would block a reader for good
    fifo.mkdir()
    shutil.copy(secret / "config.json", fifo / "config.json")
    os.mkfifo(fifo / "metrics.jsonl")
    (runs_dir / "alias").symlink_to(run_id)  # a link that stays inside is fine
    (runs_dir / run_id / "metrics-copy.jsonl").symlink_to(runs_dir / run_id / "metrics.jsonl")

    code, answer = await api("runs")
    assert code == 200
    by_id = {r["id"]: r for r in answer["runs"]}
    assert sorted(by_id) == sorted([run_id, "alias", "linked-run", "leaky-metrics", "leaky-status", "fifo-metrics"])
    for bad in ("linked-run", "leaky-metrics", "leaky-status"):
        assert by_id[bad] == {"id": bad, "readable": False, "path": str(runs_dir / bad), "error": by_id[bad]["error"]}
        assert "leads outside" in by_id[bad]["error"] and "not followed" in by_id[bad]["error"]
    assert "not a regular file" in by_id["fifo-metrics"]["error"]
    assert "outside-status" not in json.dumps(answer) and "4242" not in json.dumps(answer)
    assert by_id["alias"]["readable"] is True and by_id["alias"]["step"] == by_id[run_id]["step"]

    for bad in ("linked-run", "leaky-metrics"):
        code, answer = await api(f"runs/{bad}/metrics")
        assert code == 403 and "leads outside" in answer["message"], (bad, answer)
    code, answer = await api("runs/fifo-metrics/metrics")
    assert code == 403 and "not a regular file" in answer["message"]
    code, answer = await api("runs/alias/metrics")
    assert code == 200 and len(answer["records"]) == len(RunDir(runs_dir / run_id).read_metrics())


@pytest.mark.parametrize(
    "raw,code",
    [
        ("..", 400),
        ("%2e%2e", 400),
        (".", 400),
        ("%2e", 400),
        ("..%2F..%2Foutside%2F" + OUTSIDE_RUN, 400),
        ("%2Ftmp", 400),
        ("%5C..", 400),
        (".hidden", 400),
        ("a%00b", 400),
        ("no-such-run", 404),
    ],
)
async def test_run_ids_that_are_not_a_folder_name_are_refused(api, served_run, outside, raw, code):
    got, answer = await api(f"runs/{raw}/metrics")
    assert got == code, answer
    assert answer["message"].startswith("bad run id" if code == 400 else "no run directory")


async def test_raw_dot_segments_never_reach_outside(api, served_run, outside):
    # However the client or server normalizes them, these must not serve the outside run.
    for raw in ("../outside/" + OUTSIDE_RUN, "..%2F..%2F" + OUTSIDE_RUN, "%2e%2e/%2e%2e/runs"):
        code, answer = await api(f"runs/{raw}/metrics")
        assert code in (400, 404), (raw, code, answer)
        assert "records" not in answer and "outside-status" not in json.dumps(answer)


@pytest.fixture
def linked_notebook(tmp_path, monkeypatch):
    """A notebooks folder holding one real notebook and one link to a notebook outside it."""
    nb = {
        "cells": [{"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["# Secret\n"]}],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (tmp_path / "secret.ipynb").write_text(json.dumps(nb))
    source = tmp_path / "nb-source"
    source.mkdir()
    (source / "01_real.ipynb").write_text(json.dumps(nb).replace("Secret", "Real"))
    (source / "02_link.ipynb").symlink_to(tmp_path / "secret.ipynb")
    monkeypatch.setenv("WORKBENCH_NOTEBOOKS_DIR", str(source))
    return source


async def test_notebook_links_out_of_the_folder_are_not_served(api, linked_notebook, jp_root_dir, user_notebooks):
    code, listing = await api("notebooks")
    assert code == 200 and [n["name"] for n in listing["notebooks"]] == ["01_real.ipynb"]
    code, answer = await api("notebooks/02_link.ipynb", method="POST")
    assert code == 403 and "leads outside" in answer["message"]
    for raw in ("..%2Fsecret.ipynb", "%2e%2e%2Fsecret.ipynb", "%2Ftmp%2Fsecret.ipynb"):
        code, answer = await api(f"notebooks/{raw}", method="POST")
        assert code == 400 and "is not a notebook file name" in answer["message"], (raw, answer)
    assert sorted(p.name for p in jp_root_dir.iterdir()) == []
    code, answer = await api("notebooks/01_real.ipynb", method="POST")
    assert code == 200 and answer["path"] == "moe-workbench/notebooks/01_real.ipynb" and answer["copied"] is True


async def test_runs_poll_reads_only_appended_bytes_with_a_bound(api, served_run, jp_serverapp):
    runs_dir, run_id = served_run
    run = RunDir(runs_dir / run_id)
    run.metrics_path.unlink()
    steps = 6000
    size = _append(run.metrics_path, _records(1, steps))  # ~2.3 MB of 12000 records
    limits = IndexLimits(spark_points=16, max_bytes_per_poll=2**19, chunk_bytes=2**16)
    index = RunIndex(limits)
    jp_serverapp.web_app.settings[RUN_INDEX_KEY] = index

    polls = []
    while True:  # the bound: each poll reads at most max_bytes_per_poll and says what is left
        before = index.bytes_read
        code, answer = await api("runs")
        assert code == 200
        polls.append(index.bytes_read - before)
        [summary] = answer["runs"]
        if "metrics_pending_bytes" not in summary:
            break
        assert summary["metrics_pending_bytes"] == size - index.bytes_read
        assert len(polls) < 20
    assert max(polls) == limits.max_bytes_per_poll and len(polls) == -(-size // 2**19)
    assert index.bytes_read == size  # every byte read once
    assert summary["step"] == steps and summary["loss"] == pytest.approx(10.0 / steps)
    assert summary["metrics_records"] == 2 * steps
    spark = summary["spark"]["loss"]
    assert len(spark) == 16 and spark[0] == 10.0 and spark[-1] == pytest.approx(10.0 / steps)
    assert spark == sorted(spark, reverse=True)  # spread over the whole run, in order
    # Memory: a few values per sparkline and the last record's fields, not 12000 records.
    assert index.held_values() <= 2 * 2 * limits.spark_points + 3

    code, answer = await api("runs")
    assert index.bytes_read == size  # nothing new, nothing read
    appended = _append(run.metrics_path, _records(steps + 1, 1))
    code, answer = await api("runs")
    assert index.bytes_read == size + appended
    assert answer["runs"][0]["step"] == steps + 1 and answer["runs"][0]["metrics_records"] == 2 * steps + 2

    # A line still being written is not a record yet; once finished it is, read once.
    line = json.dumps(_records(steps + 2, 1)[0]) + "\n"
    _append_raw(run.metrics_path, line[:25])
    code, answer = await api("runs")
    assert answer["runs"][0]["step"] == steps + 1
    _append_raw(run.metrics_path, line[25:])
    code, answer = await api("runs")
    assert answer["runs"][0]["step"] == steps + 2
    assert index.bytes_read == os.path.getsize(run.metrics_path)

    # Status is read fresh every poll, while the metrics file is not read again.
    run.write_status("failed", error="disk full")
    before = index.bytes_read
    code, answer = await api("runs")
    assert answer["runs"][0]["state"] == "failed" and index.bytes_read == before

    # Replaced (a new file) or truncated: read again from the start.
    replacement = run.path / "new-metrics.jsonl"
    new_size = _append(replacement, _records(1, 3))
    os.replace(replacement, run.metrics_path)
    code, answer = await api("runs")
    assert index.bytes_read == before + new_size and answer["runs"][0]["step"] == 3
    with open(run.metrics_path, "r+") as f:
        f.truncate(0)
    shorter = _append(run.metrics_path, _records(1, 1))
    code, answer = await api("runs")
    assert answer["runs"][0]["step"] == 1 and answer["runs"][0]["metrics_records"] == 2
    assert index.bytes_read == before + new_size + shorter


async def test_an_over_long_metrics_line_is_skipped_not_held(api, served_run, jp_serverapp):
    runs_dir, run_id = served_run
    run = RunDir(runs_dir / run_id)
    run.metrics_path.unlink()
    limits = IndexLimits(max_line_bytes=2**12, chunk_bytes=2**10)
    index = RunIndex(limits)
    jp_serverapp.web_app.settings[RUN_INDEX_KEY] = index
    _append(run.metrics_path, _records(1, 1))
    _append_raw(run.metrics_path, json.dumps({"step": 2, "rank": 0, "pad": "x" * 2**14}) + "\n")
    _append(run.metrics_path, _records(3, 1))
    _, answer = await api("runs")
    assert answer["runs"][0]["step"] == 3 and answer["runs"][0]["metrics_records"] == 4
    assert index.bytes_read == os.path.getsize(run.metrics_path)
