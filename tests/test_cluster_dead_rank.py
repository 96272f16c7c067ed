"""A Cluster with a dead rank says which rank died and how to recover, from every entry point."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

pytest.importorskip("ipyparallel")

from workbench.cluster import Cluster, ClusterError, RankError
from workbench.config import RunConfig


def _dead_rank_message(rank: int, pid: int) -> str:
    return (
        rf"the engine of rank {rank} \(engine id {rank}, pid {pid}\) died; "
        rf"call cluster\.restart\(\) to bring it back"
    )


def _wait_exited(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} still alive {timeout} s after SIGKILL")


def _entry_points(cluster: Cluster, tmp_path):
    """What a notebook calls on a cluster: each must fail at once with the dead rank's name."""
    return {
        "finetune": lambda: cluster.finetune(RunConfig.demo(output_dir=str(tmp_path / "a"))),
        "info": cluster.info,
        "ensure_process_group": cluster.ensure_process_group,
        "second finetune": lambda: cluster.finetune(RunConfig.demo(output_dir=str(tmp_path / "b"))),
    }


@pytest.mark.slow
def test_dead_rank_is_named_by_every_entry_point_and_restart_brings_it_back(tmp_path):
    cluster = Cluster(n=2, devices="cpu")
    try:
        # A rank killed while the cluster is idle.
        victim = cluster.local_engine_pids()[1]
        os.kill(victim, signal.SIGKILL)
        _wait_exited(victim)
        for call in _entry_points(cluster, tmp_path).values():
            with pytest.raises(ClusterError, match=_dead_rank_message(1, victim)):
                call()
        assert not cluster.running
        # The same once the controller has also dropped the engine (missed heartbeats).
        deadline = time.monotonic() + 30
        while cluster.engine_id(1) in cluster.client.ids:
            assert time.monotonic() < deadline, "the controller never noticed the dead engine"
            time.sleep(0.1)
        for call in _entry_points(cluster, tmp_path).values():
            with pytest.raises(ClusterError, match=_dead_rank_message(1, victim)):
                call()
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

        cluster.restart()
        assert cluster.running
        # A rank killed during a run: the run fails naming it, then the cluster does too.
        run = cluster.finetune(RunConfig.demo(output_dir=str(tmp_path / "runs"), train__steps=500))
        deadline = time.monotonic() + 120
        while (run.last_step or 0) < 1:
            assert not run.done and time.monotonic() < deadline, run.status
            time.sleep(0.05)
        victim = cluster.local_engine_pids()[0]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RankError) as info:
            run.wait(timeout=60)
        assert info.value.rank == 0
        for call in _entry_points(cluster, tmp_path).values():
            with pytest.raises(ClusterError, match=_dead_rank_message(0, victim)):
                call()

        cluster.restart()
        assert cluster.running and [r["rank"] for r in cluster.info()] == [0, 1]
        again = cluster.finetune(RunConfig.demo(output_dir=str(tmp_path / "runs"), train__steps=2))
        assert again.wait(timeout=300)["state"] == "completed"
        assert set(zip(again.metrics["rank"], again.metrics["step"])) == {(0, 1), (0, 2), (1, 1), (1, 2)}
    finally:
        cluster.stop()
