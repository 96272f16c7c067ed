"""The lab's run routes on a real jupyter_server: run ids it cannot serve are a 400 with the rule, never a 500;
a run whose config.json is huge does not make the runs list huge; a torn metrics line is reported.

Requests go out as raw paths (not through jp_fetch, which escapes them), as a browser or a script sends them.
"""

from __future__ import annotations

import json
import shutil

import pytest

from workbench.runs.run_dir import RunDir

pytest.importorskip("moe_workbench_lab", reason="install it: pip install -e extensions/moe_workbench_lab")
pytest.importorskip("pytest_jupyter", reason="install it: pip install 'pytest-jupyter[server]'")
pytest_plugins = ["pytest_jupyter.jupyter_server"]


@pytest.fixture
def api(http_server_client, jp_auth_header, jp_base_url):
    """GET <base>moe-workbench/api/<raw path>: (HTTP code, answer, body size)."""

    async def get(raw: str) -> tuple[int, dict, int]:
        response = await http_server_client.fetch(
            f"{jp_base_url}moe-workbench/api/{raw}",
            headers=jp_auth_header,
            raise_error=False,
            request_timeout=60,
        )
        body = response.body or b""
        if response.headers.get("Content-Type", "").startswith("application/json"):
            return response.code, json.loads(body), len(body)
        return response.code, {"page": body.decode(errors="replace")}, len(body)

    return get


@pytest.mark.parametrize(
    "raw",
    [
        "x" * 300,  # past the file system's name limit: was an OSError, a 500
        "a%20b",  # a space
        "a%5Cb",  # a backslash
        ".hidden",
        "-flag",
    ],
)
async def test_metrics_route_answers_400_naming_the_rule_for_an_id_no_run_can_have(api, served_run, raw):
    code, answer, _ = await api(f"runs/{raw}/metrics")
    assert code == 400, (raw, code, answer)
    assert (
        answer["message"].startswith("bad run id: run_id ")
        and "is not valid: use 1-128 letters, digits" in (answer["message"])
    ), answer
    assert len(answer["message"]) < 300


async def test_runs_route_lists_a_folder_no_run_id_names_as_unreadable(api, served_run):
    runs_dir, run_id = served_run
    shutil.copytree(runs_dir / run_id, runs_dir / "made by hand")
    code, answer, _ = await api("runs")
    assert code == 200
    runs = {r["id"]: r for r in answer["runs"]}
    assert runs[run_id]["readable"]
    assert (
        not runs["made by hand"]["readable"] and "run_id 'made by hand' is not valid" in runs["made by hand"]["error"]
    )


async def test_runs_route_does_not_send_a_huge_config_json(api, served_run):
    runs_dir, run_id = served_run
    config = json.loads((runs_dir / run_id / "config.json").read_text())
    huge = runs_dir / "huge-name"
    shutil.copytree(runs_dir / run_id, huge)
    (huge / "config.json").write_text(json.dumps({**config, "name": "n" * (4 * 2**20)}))
    long = runs_dir / "long-name"
    shutil.copytree(runs_dir / run_id, long)
    (long / "config.json").write_text(json.dumps({**config, "name": "m" * 50_000}))
    for _ in range(2):  # every poll, not only the first
        code, answer, size = await api("runs")
        assert code == 200 and size < 256 * 2**10, size
        runs = {r["id"]: r for r in answer["runs"]}
        assert not runs["huge-name"]["readable"] and "config.json is " in runs["huge-name"]["error"]
        assert runs["long-name"]["readable"] and runs["long-name"]["name"] == "m" * 197 + "..."
        assert runs[run_id]["readable"] and runs[run_id]["name"] == config["name"]


async def test_a_torn_last_metrics_line_is_reported_and_status_gives_the_step(api, served_run):
    runs_dir, run_id = served_run
    run = RunDir(runs_dir / run_id)
    status = run.read_status()
    records = run.read_metrics()
    last_step = max(r["step"] for r in records)
    assert status["state"] == "completed" and status["step"] == last_step
    # The writer died inside rank 0's record of the last step: the file ends half-way through that line.
    lines = run.metrics_path.read_bytes().splitlines(keepends=True)
    torn = max(i for i, line in enumerate(lines) if json.loads(line).get("rank", 0) == 0)
    kept = [line for i, line in enumerate(lines) if i != torn and json.loads(line)["step"] < last_step]
    # ... and, earlier, a line was garbled (line 2).
    run.metrics_path.write_bytes(kept[0] + b'{"step": 1, "ra\x00\n' + b"".join(kept[1:]) + lines[torn][:40])

    code, answer, _ = await api("runs")
    [summary] = [r for r in answer["runs"] if r["id"] == run_id]
    assert summary["step"] == last_step and summary["loss"] == pytest.approx(status["final_loss"])
    assert summary["progress_from"] == "status.json"
    assert summary["metrics_skipped"]["note"] == (
        f"skipped 2 damaged lines in metrics.jsonl (lines 2, {len(kept) + 2})"
    )

    code, answer, _ = await api(f"runs/{run_id}/metrics")
    assert code == 200 and max(r["step"] for r in answer["records"]) == last_step - 1
    # The plots' route names the garbled line (the unfinished last one may still be being written, to it).
    assert answer["skipped"]["note"] == "skipped 1 damaged line in metrics.jsonl (line 2)"
