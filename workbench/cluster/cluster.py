"""`Cluster`: an ipyparallel controller plus one engine per rank, joined by torch.distributed."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from workbench.cluster import engine as engine_code
from workbench.cluster import files as ipp_files
from workbench.parallel.launch import free_port
from workbench.runs.liveness import pid_alive

if TYPE_CHECKING:  # the return type of finetune (run.py imports this module)
    from workbench.cluster.run import Run

# The launchers, by ipyparallel's own engine launcher names (its entry points).
LAUNCHERS = ("local", "mpi", "slurm", "ssh")
DEFAULT_CPU_RANKS = 2
# Each local engine runs ipyparallel's IPEngine through this script (see engine_main.py: a stop
# then exits cleanly instead of with tornado's "Event loop stopped" traceback).
ENGINE_MAIN = Path(__file__).with_name("engine_main.py")


class ClusterError(RuntimeError):
    """The cluster could not start, attach, or reach its engines."""


def _resolve_devices(n: int | None, devices: str | Sequence[int]) -> tuple[str, list[int | None]]:
    """-> (device type, one GPU index or None per rank); checked before anything starts."""
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
        raise ValueError(f"n must be a positive number of ranks, got {n!r}")
    if isinstance(devices, str) and devices not in ("auto", "cpu", "cuda"):
        raise ValueError(f"devices must be 'auto', 'cpu', 'cuda' or a list of GPU indices, got {devices!r}")
    if devices == "cpu":
        return "cpu", [None] * (n or DEFAULT_CPU_RANKS)
    import torch

    gpu_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if isinstance(devices, str):
        if gpu_count == 0:
            if devices == "cuda":
                raise ClusterError("devices='cuda' but this machine has no CUDA GPU; use devices='cpu'")
            return "cpu", [None] * (n or DEFAULT_CPU_RANKS)
        if n is not None and n > gpu_count:
            raise ValueError(f"n={n} ranks but only {gpu_count} GPUs are visible; one rank per GPU")
        return "cuda", list(range(n or gpu_count))
    gpus = [int(d) for d in devices]
    if not gpus or len(set(gpus)) != len(gpus) or any(g < 0 or g >= gpu_count for g in gpus):
        raise ValueError(f"devices={list(devices)} must be distinct GPU indices in [0, {gpu_count})")
    if n is not None and n != len(gpus):
        raise ValueError(f"n={n} does not match the {len(gpus)} devices given")
    return "cuda", gpus


def _engine_pythonpath() -> str:
    # Engines must import this very `workbench`, also from a source checkout that is not installed.
    root = str(Path(engine_code.__file__).resolve().parents[2])
    existing = os.environ.get("PYTHONPATH", "")
    return root if not existing else root + os.pathsep + existing


def _wait_gone(procs: list[psutil.Process], timeout: float) -> None:
    """Wait until each process has exited (a zombie awaiting its reaper counts as exited)."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        while time.monotonic() < deadline:
            try:
                if proc.status() == psutil.STATUS_ZOMBIE:
                    break
            except psutil.NoSuchProcess:
                break
            time.sleep(0.02)


class Cluster:
    """An ipyparallel cluster with one engine per rank and torch.distributed initialized on it.

    `Cluster(n=2)` starts 2 CPU ranks (gloo) where there is no GPU, or one rank per GPU (nccl).
    Engine id == rank. Use as a context manager, or call `stop()`.
    """

    def __init__(
        self,
        n: int | None = None,
        devices: str | Sequence[int] = "auto",
        launcher: str = "local",
        *,
        start: bool = True,
        timeout: float = 60.0,
        **ipyparallel_kwargs: Any,
    ) -> None:
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {sorted(LAUNCHERS)}, got {launcher!r}")
        self.device_type, self.gpus = _resolve_devices(n, devices)
        self.world_size = len(self.gpus)
        self.backend = "nccl" if self.device_type == "cuda" else "gloo"
        self.launcher = launcher
        self.timeout = timeout
        self._ipp_kwargs = ipyparallel_kwargs
        self._owned = True
        self._ipp = None
        self.client = None
        self.view = None
        self._engine_of_rank: dict[int, int] = {}
        self.master_addr = "127.0.0.1"
        self.master_port: int | None = None
        self.startup_s: float | None = None
        if start:
            self.start()

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> Cluster:
        """Start the controller and engines, connect, and initialize the process group."""
        import ipyparallel

        if self._ipp is not None:
            raise ClusterError("cluster is already started; call stop() or restart()")
        t0 = time.perf_counter()
        kwargs = dict(log_level=40, delay=0, engines=self.launcher)
        kwargs.update(self._ipp_kwargs)
        controller_args = list(kwargs.pop("controller_args", []))
        if not any(a.startswith("--HeartMonitor.period") for a in controller_args):
            # A fast heartbeat lets a dead engine be noticed in seconds, and speeds start-up.
            controller_args.append("--HeartMonitor.period=500")
        if not any(a.startswith("--IPController.use_threads") for a in controller_args):
            # Schedulers as threads, not 8 processes: less to start on a small machine.
            controller_args.append("--IPController.use_threads=True")
        self._ipp = ipyparallel.Cluster(n=self.world_size, controller_args=controller_args, **kwargs)
        try:
            self._ipp.start_controller_sync()
            ipp_files.make_private(self.files())  # before the engines start writing their logs
            self._start_engines()
            self.client = self._ipp.connect_client_sync()
            self.client.wait_for_engines(self.world_size, timeout=self.timeout, block=True, interactive=False)
            ipp_files.make_private(self.files())  # the engines' logs, and the controller's engine state
        except Exception as err:
            output = self._engine_output()
            self._force_stop()
            raise ClusterError(
                f"could not start {self.world_size} engines with the {self.launcher!r} launcher: "
                f"{type(err).__name__}: {err}"
                + (f"\nengine output:\n{output}" if output else "")
                + (
                    ""
                    if self.launcher == "local"
                    else f"\ncheck the ipyparallel {self.launcher} launcher settings passed as keyword arguments"
                )
            ) from None
        self._map_ranks()
        self._init_process_group()
        self.startup_s = time.perf_counter() - t0
        return self

    def _start_engines(self) -> None:
        prewarm = f"--IPEngine.startup_command={engine_code.PREWARM_COMMAND}"
        common = {"WORLD_SIZE": str(self.world_size), "PYTHONPATH": _engine_pythonpath()}
        if self.launcher != "local":
            # mpiexec / srun / ssh give the rank; addresses are settled at init from rank 0.
            # Their engines may run on hosts without this file: ipyparallel's own command.
            self._ipp.start_engines_sync(n=self.world_size, environment=common, engine_args=[prewarm])
            return
        self.master_port = free_port("")
        for rank, gpu in enumerate(self.gpus):
            env = dict(
                common,
                # engine_main.py exits when this process (the kernel that owns the cluster) is gone
                WORKBENCH_CLUSTER_OWNER_PID=str(os.getpid()),
                RANK=str(rank),
                LOCAL_RANK=str(rank),
                MASTER_ADDR=self.master_addr,
                MASTER_PORT=str(self.master_port),
            )
            if gpu is not None:
                env["CUDA_VISIBLE_DEVICES"] = str(gpu)
            self._ipp.start_engines_sync(
                n=1,
                environment=env,
                engine_args=[f"--IPEngine.id={rank}", prewarm],
                engine_cmd=[sys.executable, str(ENGINE_MAIN)],
            )

    def _map_ranks(self) -> None:
        """Find which engine holds which rank: the launcher's rank, else engine-id order."""
        ids = sorted(self.client.ids)
        if len(ids) < self.world_size:
            raise ClusterError(f"expected {self.world_size} engines, {len(ids)} registered")
        ids = ids[: self.world_size]
        facts = self.client[ids].apply_sync(engine_code.launcher_rank)
        ranks = [f["rank"] for f in facts]
        if sorted(r for r in ranks if r is not None) != list(range(self.world_size)):
            ranks = list(range(self.world_size))  # no usable launcher rank: engine-id order
        self._engine_of_rank = dict(zip(ranks, ids))
        self._rank_facts = dict(zip(ranks, facts))
        self.view = self.client[[self._engine_of_rank[r] for r in range(self.world_size)]]
        self.view.block = False

    def ensure_process_group(self) -> None:
        """Re-join the process group on every rank if a failed run left it destroyed."""
        self._require_running()
        ready = self._get(self.view.apply_async(engine_code.process_group_ready))
        if not all(ready):
            if self.launcher == "local" and self.master_addr == "127.0.0.1":
                self.master_port = free_port("")
            else:
                self.master_port = None
            self._init_process_group()

    def _init_process_group(self) -> None:
        hosts = {f["hostname"] for f in self._rank_facts.values()}
        if self.launcher != "local" or self.master_port is None:
            from ipyparallel import interactive  # ships free_port by value: the engine imports no workbench

            rank0 = self.client[self._engine_of_rank[0]]
            self.master_addr = "127.0.0.1" if len(hosts) == 1 else self._rank_facts[0]["address"]
            self.master_port = rank0.apply_sync(interactive(free_port), "")
        results = []
        for rank in range(self.world_size):
            local_rank = self._rank_facts[rank]["local_rank"]
            if local_rank is None:
                local_rank = rank if len(hosts) == 1 else 0
            results.append(
                self.client[self._engine_of_rank[rank]].apply_async(
                    engine_code.init_process_group,
                    rank,
                    self.world_size,
                    local_rank,
                    self.master_addr,
                    self.master_port,
                    self.backend,
                )
            )
        try:
            for ar in results:
                ar.get(timeout=self.timeout)
        except Exception as err:
            self._force_stop()
            raise ClusterError(
                f"torch.distributed ({self.backend}) did not initialize across {self.world_size} engines: {err}"
            ) from err

    def stop(self) -> None:
        """Tear down the process group, stop engines and controller; no process is left behind."""
        if self._ipp is None:
            return
        # A barrier cannot pass with a rank dead: then the processes are only stopped.
        if self.client is not None and self.view is not None and not self.busy and not self._dead_ranks():
            try:  # barrier + destroy before exit avoids gloo's abort at process exit
                self.view.apply_async(engine_code.shutdown_process_group).get(timeout=10)
            except Exception:
                pass  # a dead or hung rank: the processes are stopped below anyway
        self._force_stop()

    def _force_stop(self) -> None:
        pids = self.pids()
        all_pids = [p for p in pids["controller"] + list(pids["engines"].values()) + pids["helpers"] if p]
        files = self.files()
        if self.client is not None:
            try:
                self.client.close()
            except Exception:
                pass
        # ipyparallel deletes the processes' output logs once they exited; a server that loaded
        # this cluster from its file (JupyterLab's cluster list) would first log each one as a
        # WARNING, since it cannot see a non-child's exit code. Nothing reads them after a stop.
        ipp_files.remove(files["logs"])
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception:
                pass
        # ipyparallel never removes the controller's engine registry (Hub._cleanup_engine_state_file
        # is not called): one file per cluster would pile up in the profile's log folder.
        ipp_files.remove(files["registry"])
        procs = []
        for pid in all_pids:
            try:
                procs.append(psutil.Process(pid))
            except psutil.NoSuchProcess:
                pass
        # Engine nannies only notice their engine is gone after seconds of polling, and take
        # more to handle SIGTERM; their engine is gone, so nothing is lost by killing them.
        for proc in procs:
            if proc.pid in pids["helpers"]:
                try:
                    proc.kill()
                except psutil.NoSuchProcess:
                    pass
        # Anything still alive (a rank stuck in a collective ignores SIGTERM) is killed.
        _, alive = psutil.wait_procs([p for p in procs if p.pid not in pids["helpers"]], timeout=5)
        for proc in alive:
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        _wait_gone([p for p in procs if p.pid in pids["helpers"]], timeout=5)
        self._ipp = self.client = self.view = None
        self._engine_of_rank = {}

    def restart(self) -> Cluster:
        """Stop everything (also after a crashed rank) and start a fresh cluster of the same shape."""
        self.stop()
        return self.start()

    def __enter__(self) -> Cluster:
        if self._ipp is None:
            self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def __del__(self) -> None:
        # ipyparallel also stops clusters at interpreter exit; this covers a dropped reference.
        try:
            if self._ipp is not None and getattr(self, "_owned", True):
                self._force_stop()
        except Exception:
            pass

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return (
            f"Cluster({self.world_size} x {self.device_type}, backend={self.backend}, "
            f"launcher={self.launcher!r}, {state})"
        )

    # -- state ---------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        """Whether the controller and every rank's engine are up."""
        if self._ipp is None or self.client is None:
            return False
        return not self._dead_ranks()

    def _dead_ranks(self) -> dict[int, str]:
        """rank -> what is known of its engine, for each rank whose engine is gone."""
        if self.client is None:
            return {}
        registered = set(self.client.ids)  # the controller drops an engine after missed heartbeats
        local = self.local_engine_pids()  # a local engine's exit is seen at once, before that
        facts = getattr(self, "_rank_facts", {})
        dead = {}
        for rank, eid in sorted(self._engine_of_rank.items()):
            exited_here = rank in local and not pid_alive(local[rank])
            if exited_here or eid not in registered:
                pid = facts.get(rank, {}).get("pid")
                dead[rank] = f"engine id {eid}" + (f", pid {pid}" if pid else "")
        return dead

    def check_ranks(self) -> None:
        """Raise a ClusterError naming each rank whose engine died, and how to recover."""
        dead = self._dead_ranks()
        if dead:
            which = ", ".join(f"rank {rank} ({facts})" for rank, facts in dead.items())
            raise ClusterError(
                f"the engine of {which} died; call cluster.restart() to bring it back "
                f"(it starts all {self.world_size} ranks afresh: a process group cannot take in a new rank)"
            )

    @property
    def busy(self) -> bool:
        """Whether any engine is still running a task (e.g. a training run)."""
        return bool(self.client is not None and self.client.outstanding)

    @property
    def cluster_id(self) -> str | None:
        return None if self._ipp is None else self._ipp.cluster_id

    def engine_id(self, rank: int) -> int:
        """The ipyparallel engine id of `rank` (equal to it for the local launcher)."""
        return self._engine_of_rank[rank]

    def pids(self) -> dict[str, Any]:
        """Local process ids: controller (+ children), each rank's engine, helpers (engine nannies)."""
        out: dict[str, Any] = {"controller": [], "engines": {}, "helpers": []}
        if self._ipp is None:
            return out
        controller = getattr(self._ipp, "controller", None)
        pid = getattr(controller, "pid", None) if controller is not None else None
        if pid:
            out["controller"].append(pid)
            try:
                out["controller"] += [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        facts = getattr(self, "_rank_facts", {})
        for rank in self._engine_of_rank:
            if rank in facts:
                out["engines"][rank] = facts[rank]["pid"]
        if not out["engines"]:  # before the ranks were mapped: ask the launchers
            for engine_set in self._ipp.engines.values():
                for launcher in getattr(engine_set, "launchers", {}).values():
                    if getattr(launcher, "pid", None):
                        out["engines"][len(out["engines"])] = launcher.pid
        for pid in out["engines"].values():  # each engine's nanny process, and anything it spawned
            try:
                out["helpers"] += [c.pid for c in psutil.Process(pid).children(recursive=True)]
            except psutil.NoSuchProcess:
                pass
        return out

    def files(self) -> dict[str, list[str]]:
        """This cluster's files on this host, by kind (cluster, connection, registry, logs)."""
        if self._ipp is None:
            return {"cluster": [], "connection": [], "registry": [], "logs": []}
        return ipp_files.find(self._ipp)

    def local_engine_pids(self) -> dict[int, int]:
        """rank -> engine pid for the ranks on this host (whose death we can see directly)."""
        import socket

        here = socket.gethostname()
        facts = getattr(self, "_rank_facts", {})
        return {r: f["pid"] for r, f in facts.items() if f.get("hostname") == here and f.get("pid")}

    def _engine_output(self) -> str:
        if self._ipp is None:
            return ""
        chunks = []
        for engine_set in self._ipp.engines.values():
            try:
                chunks.append(engine_set.get_output() or "")
            except Exception:
                pass
        return "\n".join(c for c in chunks if c)[-4000:]

    def _require_running(self) -> None:
        if self._ipp is None or self.view is None:
            raise ClusterError("the cluster is not running; call start() or restart()")
        self.check_ranks()

    def _get(self, async_result: Any) -> Any:
        """async_result.get(), naming the rank if one died meanwhile (not ipyparallel's EngineError)."""
        try:
            return async_result.get(timeout=self.timeout)
        except Exception:
            self.check_ranks()
            raise

    def info(self) -> list[dict]:
        """One record per rank: host, pid, device name and memory, installed backends, versions."""
        self._require_running()
        if self.busy:
            raise ClusterError("the engines are busy with a run; call info() when it is done")
        records = self._get(self.view.apply_async(engine_code.rank_info, self.backend))
        for rank, record in enumerate(records):
            record["engine_id"] = self._engine_of_rank[rank]
        return records

    def finetune(self, run_config: Any, **kwargs: Any) -> Run:
        """Start `workbench.train.finetune(run_config)` on every rank; returns a `Run` at once."""
        from workbench.cluster.run import Run

        self._require_running()
        return Run.launch(self, run_config, **kwargs)

    # -- attach ----------------------------------------------------------------------------
    @classmethod
    def attach(
        cls,
        cluster_id: str | None = None,
        profile: str | None = None,
        profile_dir: str | None = None,
        timeout: float = 60.0,
    ) -> Cluster:
        """Attach to a running ipyparallel cluster (lab sidebar, `ipcluster start`) and init torch."""
        import ipyparallel
        from ipyparallel.cluster import ClusterManager

        if cluster_id is None:
            manager = ClusterManager().load_clusters(profile=profile, profile_dir=profile_dir)
            found = [c for c in manager.values() if c._is_running()]
            if not found:
                raise ClusterError(
                    f"no running ipyparallel cluster found (profile={profile or 'any'}); "
                    "start one with workbench.Cluster(...) or `ipcluster start -n 2`"
                )
            if len(found) > 1:
                ids = sorted(c.cluster_id or "''" for c in found)
                raise ClusterError(f"{len(found)} running clusters {ids}; pass cluster_id=...")
            ipp = found[0]
        else:
            try:
                ipp = ipyparallel.Cluster.from_file(profile=profile, profile_dir=profile_dir, cluster_id=cluster_id)
            except FileNotFoundError:
                raise ClusterError(
                    f"no cluster file for cluster_id={cluster_id!r} (profile={profile or 'default'})"
                ) from None
        self = cls.__new__(cls)
        self._owned = False  # dropping the handle leaves the cluster running; stop() still stops it
        self._ipp = ipp
        self._ipp_kwargs = {}
        self.launcher = "local"
        self.timeout = timeout
        self.client = ipp.connect_client_sync()
        ids = self.client.ids
        if not ids:
            raise ClusterError(f"cluster {ipp.cluster_id!r} has no engines registered")
        self.world_size = len(ids)
        self.master_addr, self.master_port = "127.0.0.1", None
        self.startup_s = None
        t0 = time.perf_counter()
        self._map_ranks()
        import torch

        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.backend = "nccl" if self.device_type == "cuda" else "gloo"
        self.gpus = list(range(self.world_size)) if self.device_type == "cuda" else [None] * self.world_size
        self._init_process_group()
        self.startup_s = time.perf_counter() - t0
        return self
