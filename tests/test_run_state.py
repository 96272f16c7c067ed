"""A run's status never lies: killed runs read as "died", failed ones say why, files are private."""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from save_faults import fail_save_at

from workbench.config import RunConfig
from workbench.runs import run_dir as rd
from workbench.runs.liveness import STALE_AFTER_S, Heartbeat, checked_status, owner_fields
from workbench.runs.run_dir import RunDir
from workbench.runs.run_index import list_runs, summarize_run
from workbench.train import finetune
from workbench.train.checkpoint import DiskFullError, list_checkpoints

ROOT = Path(__file__).resolve().parents[1]


def _rc(tmp_path, **overrides) -> RunConfig:
    base = dict(
        output_dir=str(tmp_path / "runs"),
        data__seq_len=64,
        train__steps=3,
        train__global_batch_size=4,
        train__local_batch_size=2,
        train__warmup_steps=1,
    )
    base.update(overrides)
    return RunConfig.demo(**base)


def _env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def _workbench(args, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "workbench.cli", *args],
        cwd=ROOT,
        env=_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _status(path: Path) -> dict:
    try:
        return json.loads((path / "status.json").read_text())
    except (OSError, ValueError):
        return {}


def _wait_running(path: Path, proc: subprocess.Popen, step: int = 1, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = _status(path)
        if status.get("state") == "running" and (status.get("step") or 0) >= step:
            return status
        if proc.poll() is not None:
            pytest.fail(f"run ended early ({proc.returncode}): {proc.stderr.read()[-3000:]}")
        assert time.monotonic() < deadline, f"no step {step} within {timeout} s: {status}"
        time.sleep(0.1)


def _reader_state_within(path: Path, want: str, timeout: float) -> tuple[dict, float]:
    start = time.monotonic()
    while True:
        summary = summarize_run(path)
        if summary["state"] == want or time.monotonic() - start > timeout:
            return summary, time.monotonic() - start
        time.sleep(0.2)


def _finetune_yaml(tmp_path: Path, steps: int, **overrides) -> Path:
    """A `workbench finetune` config pinned to the CPU in float32: the same run on a GPU machine as here."""
    cfg = tmp_path / "cfg.yaml"
    _rc(tmp_path, train__steps=steps, model__dtype="float32", model__device="cpu", **overrides).to_yaml(cfg)
    return cfg


# -- deaths that cannot write: readers tell ------------------------------------------------------


@pytest.mark.slow
def test_sigkilled_single_process_run_reads_as_died_within_10s(tmp_path):
    cfg = _finetune_yaml(tmp_path, steps=100000)
    run = tmp_path / "runs" / "victim"
    proc = _workbench(["finetune", str(cfg), "--run-id", "victim"])
    try:
        status = _wait_running(run, proc)
        assert status["pid"] == proc.pid and status["host"] == socket.gethostname()
        first_beat = status["heartbeat_at"]
        time.sleep(2.5)  # past one heartbeat: a live run still reads as running
        assert summarize_run(run)["state"] == "running"
        assert _status(run)["heartbeat_at"] > first_beat
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    summary, took = _reader_state_within(run, "died", timeout=10)
    assert summary["state"] == "died" and took < 10, summary
    assert f"pid {proc.pid}" in summary["status"]["error"] and "while running at step" in summary["status"]["error"]
    assert _status(run)["state"] == "running"  # nothing could write; the readers decide

    from workbench.cluster.run import Run

    reopened = Run.from_dir(run)
    assert reopened.state == "died" and reopened.done
    out = subprocess.run(
        [sys.executable, "-m", "workbench.cli", "runs", str(tmp_path / "runs")],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    line = next(l for l in out.stdout.splitlines() if l.startswith("victim"))
    assert " died " in line and f"pid {proc.pid}" in line


@pytest.mark.slow
def test_sigterm_marks_the_run_failed_and_still_terminates(tmp_path):
    cfg = _finetune_yaml(tmp_path, steps=100000)
    run = tmp_path / "runs" / "termed"
    proc = _workbench(["finetune", str(cfg), "--run-id", "termed"])
    try:
        _wait_running(run, proc)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == -signal.SIGTERM  # ended the way SIGTERM ends a process
    status = _status(run)
    assert status["state"] == "failed" and status["signal"] == "SIGTERM" and status["step"] >= 1, status
    assert status["error"].startswith("rank 0 was stopped by SIGTERM")


@pytest.mark.slow
def test_run_killed_mid_save_reads_as_died(tmp_path):
    cfg = _finetune_yaml(tmp_path, steps=4, train__checkpoint_every=2)
    # The real CLI, killed by SIGKILL in the save of step 2 after its shards are written.
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "tests" / "save_faults.py"), "kill", "2", "finetune", str(cfg), "--run-id", "cut"],
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.communicate(timeout=180)
    assert proc.returncode == -signal.SIGKILL
    run = tmp_path / "runs" / "cut"
    assert (run / "checkpoints" / ".tmp-step-00000002").is_dir() and not list_checkpoints(run / "checkpoints")
    summary, _ = _reader_state_within(run, "died", timeout=10)
    assert summary["state"] == "died" and "while running at step 2" in summary["status"]["error"], summary


def test_a_stale_heartbeat_from_another_host_reads_as_died(tmp_path):
    run = RunDir.create(tmp_path, "far", {})
    now = time.time()
    base = {"state": "running", "step": 7, "pid": 1, "host": "another-host.invalid"}
    assert checked_status({**base, "heartbeat_at": now - 1}, now=now)["state"] == "running"
    died = checked_status({**base, "heartbeat_at": now - STALE_AFTER_S - 1}, now=now)
    assert died["state"] == "died" and "no heartbeat for 11 s" in died["error"] and died["recorded_state"] == "running"
    # On the owner's machine the pid decides: alive with a late heartbeat is busy, a reused pid is dead.
    here = {**owner_fields(), "state": "running", "heartbeat_at": now - 60}
    assert checked_status(here, now=now)["state"] == "running"
    if here["pid_start"] is not None:  # Linux: /proc gives the start time
        reused = checked_status({**here, "pid_start": here["pid_start"] + 1}, now=now)
        assert reused["state"] == "died" and f"pid {os.getpid()}" in reused["error"]
    # Ended runs and records without an owner are taken as written.
    assert checked_status({**base, "state": "completed", "heartbeat_at": 0.0})["state"] == "completed"
    assert checked_status({"state": "running", "step": 1})["state"] == "running"
    rd._atomic_write_json(run.status_path, {**base, "heartbeat_at": now - 60})
    assert list_runs(tmp_path)[0]["state"] == "died"


def test_heartbeat_refreshes_a_live_status_and_stops_at_the_end(tmp_path):
    run = RunDir.create(tmp_path, "hb", {})
    assert run.read_status()["pid"] == os.getpid()  # "starting" names its owner too
    run.write_status("running", step=3)
    first = run.read_status()["heartbeat_at"]
    with Heartbeat(run.beat, interval=0.02):
        deadline = time.monotonic() + 10
        while run.read_status()["heartbeat_at"] == first:
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.01)
        assert run.read_status()["step"] == 3
        run.write_status("completed", step=5)
        time.sleep(0.1)
    status = run.read_status()
    assert status["state"] == "completed" and "heartbeat_at" not in status and "pid" not in status


# -- deaths a launcher sees ----------------------------------------------------------------------


@pytest.mark.slow
def test_sigkill_of_one_demo_rank_fails_the_run_naming_rank_and_signal(tmp_path):
    proc = _workbench(["demo", "--steps", "100000", "--ranks", "2", "--run-id", "d"], WORKBENCH_RUNS_DIR=str(tmp_path))
    run = tmp_path / "d"
    try:
        rank0 = _wait_running(run, proc)["pid"]
        ranks = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        (rank1,) = [c for c in ranks if c.pid != rank0]
        rank1.send_signal(signal.SIGKILL)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    status = _status(run)
    assert status["state"] == "failed" and status["rank"] == 1 and status["signal"] == "SIGKILL", status
    assert status["error"].startswith("rank 1 was killed by SIGKILL") and status["detected_by"] == "workbench demo"
    assert summarize_run(run)["state"] == "failed"
    assert "rank 1 was killed by SIGKILL" in err


# -- failures that can write: failed, with the reason --------------------------------------------


@pytest.mark.slow
def test_disk_full_during_the_final_save_fails_the_run_and_frees_the_partial_save(tmp_path, monkeypatch):
    fail_save_at(monkeypatch, step=3, fault="disk_full")
    with pytest.raises(DiskFullError, match=r"disk full while saving step 3: [\d.]+ MiB free on ") as info:
        finetune(_rc(tmp_path, run_id="full"))
    assert info.value.errno == errno.ENOSPC
    run = tmp_path / "runs" / "full"
    status = RunDir.open(run).read_status()
    assert status["state"] == "failed" and "disk full while saving step 3" in status["error"], status
    assert not [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_status_is_written_in_place_when_the_disk_has_no_room_for_a_temporary(tmp_path, monkeypatch):
    run = RunDir.create(tmp_path, "r", {})
    run.write_status("running", step=2)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(rd.tempfile, "mkstemp", no_space)
    run.write_status("failed", error="OSError: disk full", traceback="Traceback ...\n" * 200)
    status = run.read_status()
    assert status["state"] == "failed" and status["error"] == "OSError: disk full" and "traceback" not in status
    assert sorted(os.listdir(run.path)) == ["config.json", "status.json"]


def test_disk_full_is_recognized_inside_dcp_failures():
    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    from workbench.train.checkpoint import _disk_full

    full = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert _disk_full(CheckpointException("save failed", {1: _wrap_exception(full)}))
    assert not _disk_full(CheckpointException("save failed", {0: _wrap_exception(OSError(errno.EIO, "io"))}))
    try:
        try:
            raise full
        except OSError as err:
            raise RuntimeError("wrapped") from err
    except RuntimeError as wrapped:
        assert _disk_full(wrapped)


def test_runs_command_without_a_runs_directory(tmp_path, capsys):
    from workbench.cli import main

    assert main(["runs", str(tmp_path / "nowhere")]) == 2
    assert "no runs directory at" in capsys.readouterr().err
    assert main(["runs", str(tmp_path)]) == 0 and "no runs in" in capsys.readouterr().out


# -- file modes ---------------------------------------------------------------------------------


def _modes(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath, name)
            out[str(path.relative_to(root))] = oct(stat.S_IMODE(path.lstat().st_mode))
    return out


def test_everything_a_run_leaves_is_private_and_the_umask_is_restored(tmp_path, monkeypatch):
    old = os.umask(0o022)  # a permissive default, as most users have
    try:
        finetune(_rc(tmp_path, run_id="priv", train__steps=2, train__checkpoint_every=1, train__export_hf=True))
        with monkeypatch.context() as patch:
            fail_save_at(patch, step=1, fault="error")
            with pytest.raises(RuntimeError, match="on purpose"):
                finetune(_rc(tmp_path, run_id="broken", train__steps=2, train__checkpoint_every=1))
        assert os.umask(0o022) == 0o022  # restored after a completed and after a failed run
    finally:
        os.umask(old)
    modes = _modes(tmp_path / "runs")
    assert any(k.startswith("priv/checkpoints/step-00000001/") and k.endswith(".distcp") for k in modes)
    assert "priv/hf" in modes and "priv/metrics.jsonl" in modes and "broken/status.json" in modes
    wrong = {k: m for k, m in modes.items() if m != ("0o700" if (tmp_path / "runs" / k).is_dir() else "0o600")}
    assert not wrong, wrong
    assert oct(stat.S_IMODE((tmp_path / "runs").stat().st_mode)) == "0o700"
