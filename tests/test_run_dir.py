"""Run directory contract: atomic JSON, torn metrics lines, unreadable runs listed not raised."""

import json
import os
import random
import stat

import pytest

from workbench.runs import run_dir as rd
from workbench.runs.run_dir import RunDir, default_runs_dir
from workbench.runs.run_index import list_runs


def _config(dp=2, ep=2):
    return {
        "model": {"preset": "tiny", "layers": None, "path": None},
        "mesh": {"dp": dp, "ep": ep},
        "backend": {"experts": "auto", "dispatcher": "auto"},
        "resolved_backend": {"experts": "grouped_mm", "dispatcher": "alltoall"},
        "world_size": dp,
    }


def _records(step, world=2):
    rng = random.Random(step)
    return [
        {
            "step": step,
            "rank": r,
            "loss": rng.uniform(1, 10),
            "tokens_per_s_per_gpu": rng.uniform(100, 1000),
            "expert_load": [[1, 2], [3, 4]],
        }
        for r in range(world)
    ]


def test_default_runs_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WORKBENCH_RUNS_DIR", str(tmp_path / "x"))
    assert default_runs_dir() == tmp_path / "x"
    monkeypatch.delenv("WORKBENCH_RUNS_DIR")
    assert default_runs_dir().parts[-2:] == ("moe-workbench", "runs")


def test_create_writes_config_and_starting_status(tmp_path):
    run = RunDir.create(tmp_path / "runs", None, _config())
    assert run.path.parent == tmp_path / "runs" and run.run_id == run.path.name
    assert len(run.run_id.split("-")) == 3
    assert run.read_config() == _config()
    status = run.read_status()
    assert status["state"] == "starting" and status["updated_at"] > 0
    assert run.checkpoints_dir == run.path / "checkpoints"
    reopened = RunDir.open(run.path)
    assert reopened.read_config()["mesh"] == {"dp": 2, "ep": 2}
    with pytest.raises(FileExistsError, match="already exists"):
        RunDir.create(tmp_path / "runs", run.run_id, _config())


def test_bad_state_and_bad_run_id_rejected(tmp_path):
    run = RunDir.create(tmp_path, "r1", _config())
    with pytest.raises(ValueError, match="not one of"):
        run.write_status("exploded")
    with pytest.raises(ValueError, match=r"run_id .* is not valid"):
        RunDir.create(tmp_path, "../escape", _config())


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_unwritable_runs_dir_fails_early_naming_path(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(PermissionError, match=str(locked)):
            RunDir.create(locked, None, _config())
    finally:
        locked.chmod(stat.S_IRWXU)


def test_unwritable_runs_dir_under_a_file_fails_naming_path(tmp_path):
    # Works as root too: a regular file cannot hold a directory.
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="not writable") as info:
        RunDir.create(blocker / "runs", None, _config())
    assert str(blocker / "runs") in str(info.value)


def test_failed_status_write_keeps_old_file(tmp_path, monkeypatch):
    run = RunDir.create(tmp_path, "r1", _config())
    run.write_status("running", step=3, total_steps=10)
    before = run.status_path.read_text()

    def broken_replace(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(rd.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk gone"):
        run.write_status("completed", step=10)
    monkeypatch.undo()
    assert run.status_path.read_text() == before
    assert run.read_status()["step"] == 3
    assert [p.name for p in run.path.iterdir() if p.name.endswith(".tmp")] == []


def test_unserializable_status_keeps_old_file(tmp_path):
    run = RunDir.create(tmp_path, "r1", _config())
    before = run.status_path.read_text()
    with pytest.raises(TypeError):
        run.write_status("running", step=object())
    assert run.status_path.read_text() == before


def test_metrics_roundtrip_and_torn_last_line(tmp_path):
    run = RunDir.create(tmp_path, "r1", _config())
    run.append_metrics(_records(1))
    run.append_metrics(_records(2))
    with open(run.metrics_path, "a") as f:
        f.write('{"step": 3, "rank": 0, "lo')  # a writer died mid-line
    got = run.read_metrics()
    assert [(r["step"], r["rank"]) for r in got] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert got[2]["loss"] == pytest.approx(_records(2)[0]["loss"])


def test_list_runs_summary_uses_rank0_last_record(tmp_path):
    run = RunDir.create(tmp_path, "20260101-000000-aaaa", _config())
    run.append_metrics(_records(1) + _records(2))
    run.write_status("running", step=2, total_steps=5)
    [summary] = list_runs(tmp_path)
    assert summary["readable"] is True
    assert summary["id"] == run.run_id
    assert summary["model"] == "tiny"
    assert summary["mesh"] == {"dp": 2, "ep": 2}
    assert summary["backends"]["experts"] == "grouped_mm"
    assert summary["state"] == "running"
    assert summary["step"] == 2
    # The run's tokens/s (workbench.runs.throughput): step 1 is the warm-up, so step 2's mean over ranks
    step2 = [r["tokens_per_s_per_gpu"] for r in _records(2)]
    assert summary["tokens_per_s_per_gpu"] == pytest.approx(sum(step2) / len(step2))
    assert summary["tokens_per_s_steps"] == [2]
    assert summary["updated_at"] > 0
    json.dumps(summary)


def test_list_runs_flags_corrupt_and_half_written(tmp_path):
    good = RunDir.create(tmp_path, "b-good", _config())
    corrupt = tmp_path / "a-corrupt"
    corrupt.mkdir()
    (corrupt / "config.json").write_text('{"model": {"preset": "ti')
    empty = tmp_path / "c-empty"
    empty.mkdir()
    wrong_type = tmp_path / "d-list"
    wrong_type.mkdir()
    (wrong_type / "status.json").write_text("[1, 2]")
    (tmp_path / "not-a-dir.txt").write_text("ignored")
    by_id = {s["id"]: s for s in list_runs(tmp_path)}
    assert set(by_id) == {"a-corrupt", "b-good", "c-empty", "d-list"}
    assert by_id["b-good"]["readable"] is True and by_id["b-good"]["state"] == "starting"
    for bad in ("a-corrupt", "c-empty", "d-list"):
        assert by_id[bad]["readable"] is False
        assert by_id[bad]["error"]
    assert "JSONDecodeError" in by_id["a-corrupt"]["error"]
    assert good.read_config()["model"]["preset"] == "tiny"


def test_list_runs_missing_dir_is_empty(tmp_path):
    assert list_runs(tmp_path / "nope") == []


def test_list_runs_mesh_falls_back_to_recorded_sizes(tmp_path):
    config = {**_config(), "mesh": None, "dp": 2, "grad_accum": 1}
    RunDir.create(tmp_path, "r1", config)
    [summary] = list_runs(tmp_path)
    assert summary["mesh"] == {"dp": 2}


def test_run_dir_files_are_private_under_a_permissive_umask(tmp_path):
    old = os.umask(0o022)
    try:
        run = RunDir.create(tmp_path / "runs", "r", _config())
        run.append_metrics(_records(1))
        run.write_status("running", step=1)
    finally:
        os.umask(old)

    def mode(p):
        return stat.S_IMODE(p.stat().st_mode)

    assert mode(tmp_path / "runs") == 0o700 and mode(run.path) == 0o700
    assert {p.name: mode(p) for p in run.path.iterdir()} == {
        "config.json": 0o600,
        "status.json": 0o600,
        "metrics.jsonl": 0o600,
    }
