"""The /moe-workbench/api/ routes on a real jupyter_server (pytest-jupyter)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import tornado.httpclient
from make_run import RUN_NAME

from workbench.runs.run_dir import RunDir
from workbench.runs.run_kind import run_kind
from workbench.runs.throughput import run_throughput

pytest.importorskip("moe_workbench_lab", reason="install it: pip install -e extensions/moe_workbench_lab")
from moe_workbench_lab.handlers import SETTINGS_KEY

pytest.importorskip("pytest_jupyter", reason="install it: pip install 'pytest-jupyter[server]'")
pytest_plugins = ["pytest_jupyter.jupyter_server"]

ROUTES = [
    ("GET", ("gpus",)),
    ("GET", ("clusters",)),
    ("GET", ("runs",)),
    ("GET", ("runs", "some-run", "metrics")),
    ("GET", ("notebooks",)),
    ("POST", ("notebooks", "x.ipynb")),
]


async def _get_json(jp_fetch, *parts, **params):
    response = await jp_fetch("moe-workbench", "api", *parts, params=params)
    assert response.code == 200
    assert response.headers["Content-Type"].startswith("application/json")
    return json.loads(response.body)


@pytest.mark.parametrize("method,parts", ROUTES)
@pytest.mark.parametrize("auth", ["", "token not-the-token"])
async def test_every_route_refuses_without_the_token(jp_fetch, method, parts, auth):
    body = b"" if method == "POST" else None
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch(
            "moe-workbench",
            "api",
            *parts,
            method=method,
            body=body,
            headers={"Authorization": auth},
            follow_redirects=False,
        )
    assert info.value.code in (401, 403)


async def test_gpus_answer_matches_nvml(jp_fetch):
    answer = await _get_json(jp_fetch, "gpus")
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError:
        count = 0
    assert len(answer["gpus"]) == count
    if count == 0:
        assert answer["available"] is False
        assert answer["reason"]  # says why, in plain words
    else:
        gpu = answer["gpus"][0]
        assert gpu["index"] == 0 and gpu["name"]
        assert 0 < gpu["memory_used_bytes"] <= gpu["memory_total_bytes"]


async def test_no_nvidia_library_is_said_in_plain_words(jp_fetch):
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound as err:
        raw = str(err)
    else:
        pynvml.nvmlShutdown()
        pytest.skip("this machine has NVIDIA's driver library")
    answer = await _get_json(jp_fetch, "gpus")
    # The sidebar shows `reason`; NVML's own words ("NVML Shared Library Not Found") only as the detail.
    assert answer["reason"] == "No NVIDIA GPU on this machine"
    assert raw in answer["detail"] and "NVML" not in answer["reason"]


async def test_runs_reflect_run_directory(jp_fetch, served_run, jp_serverapp, monkeypatch):
    runs_dir, run_id = served_run
    run = RunDir.open(runs_dir / run_id)
    rank0 = [r for r in run.read_metrics() if r["rank"] == 0]
    settings = jp_serverapp.web_app.settings[SETTINGS_KEY]
    for how in ("env", "query", "trait"):
        if how == "env":
            answer = await _get_json(jp_fetch, "runs")
        elif how == "query":  # the sidebar's setting naming the served folder
            answer = await _get_json(jp_fetch, "runs", runs_dir=str(runs_dir))
        else:  # c.MoeWorkbenchLab.runs_dir wins over $WORKBENCH_RUNS_DIR
            monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(runs_dir.parent / "elsewhere"))
            settings.runs_dir = str(runs_dir)
            answer = await _get_json(jp_fetch, "runs")
        assert answer["runs_dir"] == str(runs_dir) and answer["exists"] is True
        [summary] = answer["runs"]
        assert summary["id"] == run_id and summary["readable"] is True
        assert summary["name"] == run.read_config()["name"] == RUN_NAME  # RunConfig.name, given at launch
        assert summary["state"] == run.read_status()["state"]
        assert summary["model"] == run.read_config()["model"]["preset"]
        assert summary["mesh"] == run.read_config()["resolved_mesh"] == {"dp": 2, "ep": 2, "cp": 1, "tp": 1}
        assert summary["backends"] == run.read_config()["resolved_backend"]
        assert summary["step"] == rank0[-1]["step"]
        # The run's one tokens/s (workbench.runs.throughput), as `workbench runs` and the Studio show it
        assert summary["tokens_per_s_per_gpu"] == pytest.approx(run_throughput(run.read_metrics()))
        assert summary["kind"] == run_kind(run.read_config())
        assert summary["spark"]["loss"] == pytest.approx([r["loss"] for r in rank0])
        assert summary["spark"]["tokens_per_s_per_gpu"] == pytest.approx([r["tokens_per_s_per_gpu"] for r in rank0])


async def test_missing_runs_dir_is_an_empty_list(jp_fetch, tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "nothing-here"))
    answer = await _get_json(jp_fetch, "runs")
    assert answer == {"runs_dir": str(tmp_path / "nothing-here"), "exists": False, "runs": []}


async def test_metrics_series(jp_fetch, served_run):
    runs_dir, run_id = served_run
    records = RunDir.open(runs_dir / run_id).read_metrics()
    answer = await _get_json(jp_fetch, "runs", run_id, "metrics", runs_dir=str(runs_dir))
    assert answer["id"] == run_id
    assert len(answer["records"]) == len(records)
    assert [r["loss"] for r in answer["records"]] == pytest.approx([r["loss"] for r in records])
    assert "expert_load" not in answer["records"][0]  # large matrices are never held or sent
    rank1 = await _get_json(jp_fetch, "runs", run_id, "metrics", rank="1", fields="step,loss")
    assert rank1["records"] == [{"step": r["step"], "loss": r["loss"]} for r in records if r["rank"] == 1]
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch("moe-workbench", "api", "runs", "no-such-run", "metrics")
    assert info.value.code == 404


async def test_metrics_serve_eval_loss_and_accuracy(jp_fetch, served_run):
    runs_dir, run_id = served_run
    records = RunDir.open(runs_dir / run_id).read_metrics()
    evals = [r for r in records if r["rank"] == 0 and "eval_loss" in r]
    assert len(evals) == 3  # data.eval_every=1 over 3 steps: the run view's dashed series
    answer = await _get_json(jp_fetch, "runs", run_id, "metrics", rank="0", fields="step,eval_loss,eval_accuracy")
    assert [r for r in answer["records"] if "eval_loss" in r] == [
        {
            "step": r["step"],
            "eval_loss": pytest.approx(r["eval_loss"]),
            "eval_accuracy": pytest.approx(r["eval_accuracy"]),
        }
        for r in evals
    ]
    default = await _get_json(jp_fetch, "runs", run_id, "metrics")  # the fields the run view asks for
    assert sum("eval_loss" in r for r in default["records"]) == sum("eval_loss" in r for r in records)


async def test_plotly_bundle_is_served_for_the_slim_figures_loader(jp_fetch):
    plotly = pytest.importorskip("plotly")
    from workbench.ui.slim_figure import BUNDLE_ROUTE, loader_esm

    route = BUNDLE_ROUTE.format(version=plotly.__version__)
    assert route in loader_esm()
    # Public like JupyterLab's static files: the page's import() must load it without the token.
    response = await jp_fetch(*route.split("/"), headers={"Authorization": ""})
    bundle = (Path(plotly.__file__).parent / "package_data" / "widgetbundle.js").read_bytes()
    assert response.body == bundle and response.headers["Content-Type"].startswith("text/javascript")
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:  # another plotly's script: not this one
        await jp_fetch("moe-workbench", "plotly", "0.0.1", "widgetbundle.js")
    assert info.value.code == 404


async def test_corrupt_and_half_written_runs_are_unreadable_not_500(jp_fetch, served_run):
    runs_dir, run_id = served_run
    corrupt = runs_dir / "00-corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model": {"preset"')
    (runs_dir / "01-empty").mkdir()  # a run that died before writing anything
    with open(runs_dir / run_id / "metrics.jsonl", "a") as f:
        f.write('{"step": 99, "rank": 0, "lo')  # a writer killed mid-line
    answer = await _get_json(jp_fetch, "runs")
    by_id = {r["id"]: r for r in answer["runs"]}
    assert by_id["00-corrupt"]["readable"] is False and "JSON" in by_id["00-corrupt"]["error"]
    assert by_id["01-empty"]["readable"] is False and by_id["01-empty"]["error"]
    assert by_id[run_id]["readable"] is True and by_id[run_id]["step"] != 99
    metrics = await _get_json(jp_fetch, "runs", run_id, "metrics")
    assert all(r["step"] != 99 for r in metrics["records"])
    corrupt_metrics = await _get_json(jp_fetch, "runs", "00-corrupt", "metrics")
    assert corrupt_metrics["records"] == []


async def test_a_running_run_whose_process_is_gone_reads_as_died(jp_fetch, served_run):
    runs_dir, run_id = served_run
    # A process records itself as the run's owner, then vanishes without recording an end (SIGKILL).
    code = (
        "import os, signal, sys; from workbench.runs.run_dir import RunDir; "
        "RunDir.open(sys.argv[1]).write_status('running', step=2); os.kill(os.getpid(), signal.SIGKILL)"
    )
    done = subprocess.run([sys.executable, "-c", code, str(runs_dir / run_id)], timeout=60)
    assert done.returncode == -signal.SIGKILL
    assert RunDir.open(runs_dir / run_id).read_status()["state"] == "running"  # what the file still says
    [summary] = (await _get_json(jp_fetch, "runs"))["runs"]
    assert summary["state"] == "died"
    assert f"pid {json.loads((runs_dir / run_id / 'status.json').read_text())['pid']}" in summary["error"]


async def test_clusters_lists_a_real_ipyparallel_cluster(jp_fetch, jp_home_dir):
    ipp = pytest.importorskip("ipyparallel")
    empty = await _get_json(jp_fetch, "clusters")
    assert empty == {"available": True, "reason": None, "clusters": []}
    # jp_environ points HOME at jp_home_dir, so this is the profile the route scans.
    profile_dir = jp_home_dir / ".ipython" / "profile_default"
    cluster = ipp.Cluster(
        n=0,
        cluster_id="lab-test",
        profile_dir=str(profile_dir),
        log_level=40,
        controller_args=["--HeartMonitor.period=500"],
    )
    await cluster.start_controller()
    try:
        for rank in range(2):
            await cluster.start_engines(n=1, engine_args=[f"--IPEngine.id={rank}"])
        answer = await _get_json(jp_fetch, "clusters")
        [model] = answer["clusters"]
        assert model["cluster_id"] == "lab-test"
        assert model["n_engines"] == 2
        assert [r["rank"] for r in model["ranks"]] == [0, 1]
        engine_pids = sorted(es.to_dict()["engines"]["0"]["pid"] for es in cluster.engines.values())
        assert sorted(r["pid"] for r in model["ranks"]) == engine_pids
        assert model["controller"]["pid"] == cluster.controller.process.pid

        # Polling (the sidebar does every few seconds) must not start new waiter threads: the ones
        # ipyparallel attaches to each process it loads, named "wait(pid=...)". Counted by name,
        # not by threading.active_count(): an unrelated server thread once made that count flaky.
        def waiters():
            return sorted(t.name for t in threading.enumerate() if t.name.startswith("wait("))

        before = waiters()
        assert len(before) >= 3, before  # this test's own controller and two engines
        for _ in range(5):
            assert (await _get_json(jp_fetch, "clusters"))["clusters"][0]["id"] == model["id"]
        assert waiters() == before
    finally:
        await cluster.stop_cluster()
    after = await _get_json(jp_fetch, "clusters")
    assert after["clusters"] == []


@pytest.fixture
def notebooks_dir(tmp_path, monkeypatch):
    source = tmp_path / "nb-source"
    source.mkdir()
    nb = {
        "cells": [{"cell_type": "markdown", "id": "intro", "metadata": {}, "source": ["# Quickstart: tiny MoE\n"]}],
        "metadata": {},
        "nbformat": 4,
        "nbformat_minor": 5,
    }
    (source / "01_quickstart.ipynb").write_text(json.dumps(nb))
    monkeypatch.setenv("WORKBENCH_NOTEBOOKS_DIR", str(source))
    return source


async def test_notebooks_copied_once_never_overwritten(jp_fetch, jp_root_dir, notebooks_dir, user_notebooks):
    listing = await _get_json(jp_fetch, "notebooks")
    assert listing["notebooks"] == [{"name": "01_quickstart.ipynb", "title": "Quickstart: tiny MoE"}]
    response = await jp_fetch("moe-workbench", "api", "notebooks", "01_quickstart.ipynb", method="POST", body=b"")
    copy = user_notebooks / "01_quickstart.ipynb"
    assert json.loads(response.body) == {
        "path": "moe-workbench/notebooks/01_quickstart.ipynb",
        "file": str(copy),
        "copied": True,
    }
    assert json.loads(copy.read_text())["cells"][0]["source"] in (
        "# Quickstart: tiny MoE\n",
        ["# Quickstart: tiny MoE\n"],
    )
    edited = copy.read_text().replace("Quickstart", "My edits")
    copy.write_text(edited)
    again = await jp_fetch("moe-workbench", "api", "notebooks", "01_quickstart.ipynb", method="POST", body=b"")
    assert json.loads(again.body)["copied"] is False
    assert copy.read_text() == edited
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await jp_fetch("moe-workbench", "api", "notebooks", "missing.ipynb", method="POST", body=b"")
    assert info.value.code == 404


def test_repository_notebooks_found_without_env(monkeypatch):
    """With the workbench installed from this checkout, notebooks/ beside it is the source."""
    import workbench
    from moe_workbench_lab.notebooks import notebooks_source_dir

    monkeypatch.delenv("WORKBENCH_NOTEBOOKS_DIR", raising=False)
    source, reason = notebooks_source_dir()
    expected = os.path.join(os.path.dirname(os.path.dirname(workbench.__file__)), "notebooks")
    if os.path.isdir(expected):
        assert str(source) == os.path.realpath(expected) and reason is None
    else:
        assert source is None and reason
