"""`Cluster`: an ipyparallel controller plus one engine per rank, joined by torch.distributed."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import workbench.cluster.engine as engine_code
import workbench.cluster.files as ipp_files
import workbench.cluster.processes as processes
import workbench.cluster.startup as startup
from workbench.cluster.errors import ClusterError
from workbench.cluster.placement import DEFAULT_CPU_RANKS, LAUNCHERS, resolve_devices
from workbench.cluster.run import Run
from workbench.cluster.startup import ENGINE_MAIN
from workbench.parallel.launch import free_port
from workbench.runs.liveness import pid_alive

__all__ = ["DEFAULT_CPU_RANKS", "ENGINE_MAIN", "LAUNCHERS", "Cluster", "ClusterError"]


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
        self.device_type, self.gpus = resolve_devices(n, devices)
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
            startup.start_controller(self._ipp)
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
        # No port yet: the controller and engines bind ports of their own while they start, and one of them
        # could take a port picked now (EADDRINUSE at init, seen in CI); _init_process_group picks it just before use.
        self.master_port = None
        startup.start_engines(self._ipp, self.launcher, self.gpus, self.master_addr, None)

    def _map_ranks(self) -> None:
        """Find which engine holds which rank (see startup.map_ranks), and view the ranks in order."""
        self._engine_of_rank, self._rank_facts = startup.map_ranks(self.client, self.world_size)
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
        if self.launcher == "local" and self.master_port is None and self.master_addr == "127.0.0.1":
            self.master_port = free_port("")
        if self.launcher != "local" or self.master_port is None:
            from ipyparallel import interactive  # ships free_port by value: the engine imports no workbench

            rank0 = self.client[self._engine_of_rank[0]]
            self.master_addr = "127.0.0.1" if len(hosts) == 1 else self._rank_facts[0]["address"]
            self.master_port = rank0.apply_sync(interactive(free_port), "")
        results = startup.start_process_group(
            self.client,
            self._engine_of_rank,
            self._rank_facts,
            self.world_size,
            self.master_addr,
            self.master_port,
            self.backend,
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
        processes.kill_leftovers(pids)
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
        return processes.cluster_pids(self._ipp, self._engine_of_rank, getattr(self, "_rank_facts", {}))

    def files(self) -> dict[str, list[str]]:
        """This cluster's files on this host, by kind (cluster, connection, registry, logs)."""
        if self._ipp is None:
            return {"cluster": [], "connection": [], "registry": [], "logs": []}
        return ipp_files.find(self._ipp)

    def local_engine_pids(self) -> dict[int, int]:
        """rank -> engine pid for the ranks on this host (whose death we can see directly)."""
        return processes.local_engine_pids(getattr(self, "_rank_facts", {}))

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
        ipp = startup.find_running(cluster_id, profile, profile_dir)
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
