"""GET /runs/<id>/metrics (the run view polls it every 3 s) on a real jupyter_server: incremental, bounded.

The server's one RunIndex keeps, per metrics file, a byte offset and each rank's records (plotted
fields only) thinned evenly over the whole run; a request reads at most max_bytes_per_poll new bytes.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import tornado.httpclient
from make_run import append_records, append_text, trainer_records

from workbench.runs.run_dir import RunDir
from workbench.runs.run_index import SERIES_FIELDS, IndexLimits, RunIndex

pytest.importorskip("moe_workbench_lab", reason="install it: pip install -e extensions/moe_workbench_lab")
from moe_workbench_lab.handlers import RUN_INDEX_KEY

pytest.importorskip("pytest_jupyter", reason="install it: pip install 'pytest-jupyter[server]'")
pytest_plugins = ["pytest_jupyter.jupyter_server"]


async def _metrics(jp_fetch, run_id: str, **params) -> dict:
    response = await jp_fetch("moe-workbench", "api", "runs", run_id, "metrics", params=params)
    return json.loads(response.body)


async def _refused(jp_fetch, run_id: str, **params) -> tuple[int, str]:
    with pytest.raises(tornado.httpclient.HTTPClientError) as info:
        await _metrics(jp_fetch, run_id, **params)
    return info.value.code, json.loads(info.value.response.body)["message"]


@pytest.fixture
def fresh_run(served_run) -> RunDir:
    """The served demo run with its metrics file removed (each test writes its own)."""
    runs_dir, run_id = served_run
    run = RunDir(runs_dir / run_id)
    run.metrics_path.unlink()
    return run


def _use(jp_serverapp, limits: IndexLimits) -> RunIndex:
    index = RunIndex(limits)
    jp_serverapp.web_app.settings[RUN_INDEX_KEY] = index
    return index


def _steps(records: list[dict], rank: int) -> list[int]:
    return [r["step"] for r in records if r["rank"] == rank]


async def test_run_view_reads_only_appended_bytes_and_holds_a_bounded_series(jp_fetch, fresh_run, jp_serverapp):
    steps, points = 6000, 50
    size = append_records(fresh_run.metrics_path, trainer_records(1, steps))  # ~2.3 MB, 12000 records
    limits = IndexLimits(series_points=points, max_bytes_per_poll=2**19, chunk_bytes=2**16)
    index = _use(jp_serverapp, limits)
    run_id = fresh_run.path.name

    polls = []
    while True:  # the bound: each request reads at most max_bytes_per_poll and says what is left
        before = index.bytes_read
        answer = await _metrics(jp_fetch, run_id)
        polls.append(index.bytes_read - before)
        assert answer["id"] == run_id and answer["path"] == str(fresh_run.path)
        if "pending_bytes" not in answer:
            break
        assert answer["pending_bytes"] == size - index.bytes_read
        assert len(polls) < 20
    assert max(polls) == limits.max_bytes_per_poll and len(polls) == -(-size // 2**19)
    assert index.bytes_read == size  # every byte read once
    assert answer["records_seen"] == 2 * steps

    records = answer["records"]
    assert len(records) == 2 * points and index.held_records() <= 2 * (2 * points + 1)
    for rank in (0, 1):  # each rank thinned evenly over the whole run, in order, ending at the latest
        kept = _steps(records, rank)
        assert len(kept) == points and kept[0] == 1 and kept[-1] == steps and kept == sorted(kept)
        gaps = [b - a for a, b in zip(kept, kept[1:])]
        assert max(gaps) <= 2 * steps // points
    assert all(set(r) <= set(SERIES_FIELDS) for r in records)  # no expert_load matrices held
    assert records[-1]["loss"] == pytest.approx(10.0 / steps)

    await _metrics(jp_fetch, run_id)
    assert index.bytes_read == size  # nothing new, nothing read
    appended = append_records(fresh_run.metrics_path, trainer_records(steps + 1, 1))
    answer = await _metrics(jp_fetch, run_id)
    assert index.bytes_read == size + appended  # only the appended bytes
    assert _steps(answer["records"], 0)[-1] == _steps(answer["records"], 1)[-1] == steps + 1
    assert len(answer["records"]) == 2 * points and answer["records_seen"] == 2 * steps + 2

    # A line still being written is not a record yet; once finished it is.
    line = json.dumps(trainer_records(steps + 2, 1)[0]) + "\n"
    append_text(fresh_run.metrics_path, line[:25])
    assert _steps((await _metrics(jp_fetch, run_id))["records"], 0)[-1] == steps + 1
    append_text(fresh_run.metrics_path, line[25:])
    assert _steps((await _metrics(jp_fetch, run_id))["records"], 0)[-1] == steps + 2
    assert index.bytes_read == os.path.getsize(fresh_run.metrics_path)

    # The filters work on the held records, reading nothing again.
    before = index.bytes_read
    rank1 = await _metrics(jp_fetch, run_id, rank="1", fields="step,loss")
    assert rank1["records"] == [{"step": r["step"], "loss": r["loss"]} for r in answer["records"] if r["rank"] == 1]
    everything = await _metrics(jp_fetch, run_id, fields="*")
    assert everything["records"] == (await _metrics(jp_fetch, run_id))["records"]
    assert index.bytes_read == before


async def test_fields_the_server_does_not_hold_are_refused_clearly(jp_fetch, fresh_run, jp_serverapp):
    append_records(fresh_run.metrics_path, trainer_records(1, 3))
    index = _use(jp_serverapp, IndexLimits())
    code, message = await _refused(jp_fetch, fresh_run.path.name, fields="step,expert_load")
    assert code == 400 and message.startswith("fields expert_load are not served")
    assert "RunDir(" in message and str(fresh_run.path) in message and "read_metrics()" in message
    assert index.bytes_read == 0  # refused before reading


async def test_run_view_rereads_a_truncated_or_replaced_metrics_file(jp_fetch, fresh_run, jp_serverapp):
    index = _use(jp_serverapp, IndexLimits())
    run_id = fresh_run.path.name
    first = append_records(fresh_run.metrics_path, trainer_records(1, 5))
    assert _steps((await _metrics(jp_fetch, run_id))["records"], 0) == [1, 2, 3, 4, 5]

    replacement = fresh_run.path / "new-metrics.jsonl"  # a new run written to the same place
    second = append_records(replacement, trainer_records(100, 2))
    os.replace(replacement, fresh_run.metrics_path)
    answer = await _metrics(jp_fetch, run_id)
    assert _steps(answer["records"], 0) == [100, 101] and answer["records_seen"] == 4
    assert index.bytes_read == first + second

    with open(fresh_run.metrics_path, "r+") as f:  # truncated in place (same inode)
        f.truncate(0)
    third = append_records(fresh_run.metrics_path, trainer_records(7, 1))
    answer = await _metrics(jp_fetch, run_id)
    assert _steps(answer["records"], 0) == [7] and answer["records_seen"] == 2
    assert index.bytes_read == first + second + third


async def test_a_cached_run_is_never_served_through_a_link_out(jp_fetch, fresh_run, jp_serverapp, tmp_path):
    _use(jp_serverapp, IndexLimits())
    run_id = fresh_run.path.name
    append_records(fresh_run.metrics_path, trainer_records(1, 2))
    assert len((await _metrics(jp_fetch, run_id))["records"]) == 4  # now held by the index
    secret = tmp_path / "outside-metrics.jsonl"
    append_records(secret, [{"step": 4242, "rank": 0, "loss": 1.0}])
    fresh_run.metrics_path.unlink()
    fresh_run.metrics_path.symlink_to(secret)  # swapped for a link out after it was cached
    code, message = await _refused(jp_fetch, run_id)
    assert code == 403 and "leads outside" in message and "not followed" in message
    fresh_run.metrics_path.unlink()
    os.mkfifo(fresh_run.metrics_path)
    code, message = await _refused(jp_fetch, run_id)
    assert code == 403 and "not a regular file" in message


async def test_series_are_held_for_a_bounded_number_of_runs(jp_fetch, fresh_run, jp_serverapp):
    index = _use(jp_serverapp, IndexLimits(series_runs=2))
    append_records(fresh_run.metrics_path, trainer_records(1, 10))
    runs_dir = fresh_run.path.parent
    for copy in ("copy-a", "copy-b"):
        shutil.copytree(fresh_run.path, runs_dir / copy)
    for run_id in (fresh_run.path.name, "copy-a", "copy-b"):
        assert len((await _metrics(jp_fetch, run_id))["records"]) == 20
    assert index.held_records() <= 2 * 2 * (10 + 1)  # two runs of two ranks, not three
    before = index.bytes_read
    await _metrics(jp_fetch, "copy-b")  # still held: nothing read again
    assert index.bytes_read == before
    await _metrics(jp_fetch, fresh_run.path.name)  # dropped, asked for longest ago: read again
    assert index.bytes_read == before + os.path.getsize(fresh_run.metrics_path)
