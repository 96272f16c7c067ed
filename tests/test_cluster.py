"""workbench.cluster.Cluster on real ipyparallel engines with a real gloo process group (CPU)."""

from __future__ import annotations

import asyncio
import glob
import logging
import os
import shutil
import stat
import threading
import time

import psutil
import pytest

pytest.importorskip("ipyparallel")

from workbench.cluster import Cluster, ClusterError
from workbench.cluster import engine as engine_code


def _all_pids(cluster: Cluster) -> set[int]:
    """Controller, its children, every engine and its children (ipyparallel's nanny)."""
    pids = cluster.pids()
    found = set(pids["controller"]) | set(pids["engines"].values()) | set(pids["helpers"])
    for pid in list(found):
        try:
            found |= {c.pid for c in psutil.Process(pid).children(recursive=True)}
        except psutil.NoSuchProcess:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _allreduce_sum(value: float) -> float:
    import torch
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t)
    return float(t.item())


_allreduce_sum.__module__ = "__main__"  # ship by value: tests/ is not importable on engines


@pytest.mark.slow
def test_start_stop_leaves_no_process_and_sets_rank_environment():
    cluster = Cluster(n=2, devices="cpu")
    try:
        print(f"\n2-rank CPU cluster start-up: {cluster.startup_s:.2f} s")
        # The issue asks for < 5 s on an idle 2-core machine; allow slack for a loaded CI runner.
        assert cluster.startup_s < 15
        assert cluster.running and cluster.world_size == 2 and cluster.backend == "gloo"
        assert [cluster.engine_id(r) for r in range(2)] == [0, 1]
        envs = cluster.view.apply_async(engine_code.engine_environment).get(timeout=30)
        assert [e["RANK"] for e in envs] == ["0", "1"]
        assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
        assert {e["WORLD_SIZE"] for e in envs} == {"2"}
        assert {e["MASTER_PORT"] for e in envs} == {str(cluster.master_port)}
        assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
        # The process group is real: ranks 0 and 1 contribute 1 and 2.
        ranks_plus_one = [cluster.client[cluster.engine_id(r)].apply_async(_allreduce_sum, r + 1.0) for r in range(2)]
        assert [ar.get(timeout=30) for ar in ranks_plus_one] == [3.0, 3.0]
        # The mpi/slurm/ssh way in: rank 0's engine picks the port (workbench's free_port, shipped by value).
        cluster.master_port = None
        cluster._init_process_group()
        envs = cluster.view.apply_async(engine_code.engine_environment).get(timeout=30)
        assert {e["MASTER_PORT"] for e in envs} == {str(cluster.master_port)}
        again = [cluster.client[cluster.engine_id(r)].apply_async(_allreduce_sum, 2.0) for r in range(2)]
        assert [ar.get(timeout=30) for ar in again] == [4.0, 4.0]
        pids = _all_pids(cluster)
        assert len(pids) >= 3 and all(_alive(p) for p in pids)
    finally:
        cluster.stop()
    assert not cluster.running
    assert [p for p in pids if _alive(p)] == []
    cluster.stop()  # idempotent


@pytest.mark.slow
def test_context_manager_info_and_attach():
    with Cluster(n=2, devices="cpu") as cluster:
        records = cluster.info()
        assert [r["rank"] for r in records] == [0, 1]
        assert [r["engine_id"] for r in records] == [0, 1]
        assert len({r["pid"] for r in records}) == 2
        for r in records:
            assert r["world_size"] == 2 and r["process_group"] == "gloo" and r["device"] == "cpu"
            assert r["device_memory_gib"] > 0 and r["device_name"]
            assert r["packages"]["torch"] == r["versions"]["torch"]
            te = r["backends"]["experts.te"]
            assert te["available"] is False and "transformer_engine" in te["reason"].lower().replace(
                "transformerengine", "transformer_engine"
            )
            assert r["backends"]["experts.loop"]["available"] is True
        pids = _all_pids(cluster)

        attached = Cluster.attach(cluster_id=cluster.cluster_id)
        assert attached.world_size == 2 and attached.running
        assert [r["pid"] for r in attached.info()] == [r["pid"] for r in records]
        ars = [attached.client[attached.engine_id(r)].apply_async(_allreduce_sum, 5.0) for r in range(2)]
        assert [ar.get(timeout=30) for ar in ars] == [10.0, 10.0]
        attached.client.close()
    assert [p for p in pids if _alive(p)] == []


@pytest.mark.slow
def test_restart_gives_fresh_engines():
    cluster = Cluster(n=2, devices="cpu")
    try:
        before = {r["pid"] for r in cluster.info()}
        old_pids = _all_pids(cluster)
        cluster.restart()
        after = cluster.info()
        assert [r["rank"] for r in after] == [0, 1]
        assert before.isdisjoint({r["pid"] for r in after})
        assert [p for p in old_pids if _alive(p)] == []
    finally:
        cluster.stop()


def test_bad_arguments_fail_before_starting_anything():
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(ValueError, match="positive number of ranks"):
        Cluster(n=0)
    with pytest.raises(ValueError, match="launcher must be one of"):
        Cluster(n=2, launcher="pbs-pro")
    with pytest.raises(ValueError, match="devices must be"):
        Cluster(n=2, devices="tpu")
    import torch

    if not torch.cuda.is_available():
        with pytest.raises(ClusterError, match="no CUDA GPU"):
            Cluster(n=2, devices="cuda")
    assert {p.pid for p in psutil.Process().children(recursive=True)} == children


@pytest.mark.skipif(shutil.which("mpiexec") is not None, reason="mpiexec is installed here")
def test_mpi_launcher_without_mpiexec_says_so():
    with pytest.raises(ClusterError, match="mpi"):
        Cluster(n=2, devices="cpu", launcher="mpi", timeout=20)


def test_attach_without_a_cluster_is_a_clear_error():
    with pytest.raises(ClusterError, match=r"no cluster file|no running"):
        Cluster.attach(cluster_id="no-such-cluster-id")


def _profile_files(cluster_id: str) -> list[str]:
    """Every file in the default IPython profile (where Cluster runs) named after this cluster."""
    from IPython.paths import get_ipython_dir

    profile = os.path.join(get_ipython_dir(), "profile_default")
    return sorted(
        glob.glob(os.path.join(profile, "security", f"*{cluster_id}*"))
        + glob.glob(os.path.join(profile, "log", f"*{cluster_id}*"))
    )


@pytest.mark.slow
def test_cluster_files_are_private_and_gone_after_stop():
    cluster = Cluster(n=2, devices="cpu")
    try:
        found = _profile_files(cluster.cluster_id)
        modes = {os.path.basename(p): oct(stat.S_IMODE(os.stat(p).st_mode)) for p in found}
        # cluster file, 2 connection files, controller log, 2 engine logs, engine registry
        assert len(found) == 7, modes
        assert set(modes.values()) == {"0o600"}, modes
        files = cluster.files()
        assert sorted(p for paths in files.values() for p in paths) == found
        assert [len(files[k]) for k in ("cluster", "connection", "registry", "logs")] == [1, 2, 1, 3]
        cluster_id = cluster.cluster_id
    finally:
        cluster.stop()
    # ipyparallel removes its files at stop except the controller's engine registry
    # (log/engines<id>.json), which piled up one per cluster.
    assert _profile_files(cluster_id) == []


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def starting(self, prefix: str) -> list[str]:
        return [r.getMessage() for r in self.records if r.getMessage().startswith(prefix)]

    def text(self, min_level: int = logging.DEBUG) -> str:
        return "\n".join(r.getMessage() for r in self.records if r.levelno >= min_level)


def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.slow
def test_stop_logs_no_traceback_in_a_notebook_kernel_loop(caplog, capfd):
    """In a Jupyter kernel, code runs inside an asyncio loop: ipyparallel then watches its
    processes on a live loop and logs each exit; an engine stopped by SIGTERM used to exit 1
    with tornado's "Event loop stopped before Future completed." traceback."""
    caplog.set_level(logging.DEBUG, logger="ipyparallel")

    def engine_sets_stopped() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine set stopped")]

    async def start_and_stop() -> None:
        # At DEBUG ipyparallel also copies every process's output to stderr.
        cluster = Cluster(n=2, devices="cpu", log_level=logging.DEBUG)
        cluster.stop()
        # The exits are reported on ipyparallel's loop thread, just after stop() returns.
        _wait_for(lambda: len(engine_sets_stopped()) == 2)

    asyncio.run(start_and_stop())
    stderr = capfd.readouterr().err
    assert "Completed registration" in stderr  # the engines' output did reach stderr
    assert all("'exit_code': 0" in m for m in engine_sets_stopped()), engine_sets_stopped()
    for text in (caplog.text, stderr):
        assert "Event loop stopped" not in text and "Traceback" not in text
    assert [r.getMessage()[:300] for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.slow
def test_stop_logs_nothing_in_a_server_that_watches_the_cluster():
    """The JupyterLab server loads running clusters from their files (the lab's cluster list
    through ipyparallel's ClusterManager) and logs each process's exit and output."""
    import ipyparallel

    log = logging.getLogger("test_cluster.lab_server")
    log.setLevel(logging.DEBUG)
    log.propagate = False
    handler = _Records()
    log.addHandler(handler)
    loop = asyncio.new_event_loop()
    server = threading.Thread(target=loop.run_forever, name="lab-server-loop", daemon=True)
    server.start()
    cluster = Cluster(n=2, devices="cpu")
    try:

        async def load():  # on the server's loop, as the lab's request handler does
            # ClusterManager.load_clusters loads each cluster file so; only ours here, as other
            # processes on this machine may run clusters in the same profile.
            return ipyparallel.Cluster.from_file(profile="default", cluster_id=cluster.cluster_id, log=log)

        watched = asyncio.run_coroutine_threadsafe(load(), loop).result(timeout=30)
        assert watched._is_running() and len(watched.engines) == 2
        cluster.stop()
        _wait_for(
            lambda: (
                len(handler.starting("Controller stopped")) == 1 and len(handler.starting("engine set stopped")) == 2
            )
        )
    finally:
        cluster.stop()
        loop.call_soon_threadsafe(loop.stop)
        server.join(timeout=10)
        loop.close()
        log.removeHandler(handler)
    assert "Event loop stopped" not in handler.text() and "Traceback" not in handler.text()
    assert handler.text(logging.WARNING) == ""


_OWNER_SCRIPT = """
import sys, time
from workbench.cluster import Cluster
cluster = Cluster(n=2, devices="cpu")
pids = cluster.pids()
print("ENGINES", *sorted(pids["engines"].values()), flush=True)
print("CONTROLLER", *pids["controller"], flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_engines_exit_when_the_process_that_owns_the_cluster_dies(tmp_path):
    # A kernel JupyterLab kills (or a crashed script) left its engines training a run nobody could stop.
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    owner = subprocess.Popen(
        [sys.executable, "-c", _OWNER_SCRIPT], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        line = ""
        deadline = time.monotonic() + 120
        while not line.startswith("ENGINES") and time.monotonic() < deadline:
            line = owner.stdout.readline()
            assert line or owner.poll() is None, "the owner exited before its cluster started"
        engines = [int(p) for p in line.split()[1:]]
        assert len(engines) == 2 and all(_alive(p) for p in engines)
        line = owner.stdout.readline()
        assert line.startswith("CONTROLLER"), line
        controller = [int(p) for p in line.split()[1:]]
        assert controller and all(_alive(p) for p in controller)
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in engines + controller) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not any(_alive(p) for p in engines), "engines outlived the process that owns the cluster"
    # the controller too: it stayed behind for good, with its ports, once its kernel was killed
    assert not any(_alive(p) for p in controller), "the controller outlived the process that owns the cluster"
