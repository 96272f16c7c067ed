"""Bringing a cluster's ranks up: engine launch (or a running cluster to attach), rank mapping, process-group init."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import workbench.cluster.engine as engine_code
from workbench.cluster.errors import ClusterError
from workbench.cluster.owner_watch import OWNER_ENV  # engine_main.py and controller_main.py exit once it is gone

# Each local engine runs ipyparallel's IPEngine through this script (see engine_main.py: a stop
# then exits cleanly instead of with tornado's "Event loop stopped" traceback).
ENGINE_MAIN = Path(__file__).with_name("engine_main.py")
# The local controller runs ipyparallel's through this script, which exits once the cluster's owner is gone.
CONTROLLER_MAIN = Path(__file__).with_name("controller_main.py")


def _engine_pythonpath() -> str:
    # Engines must import this very `workbench`, also from a source checkout that is not installed.
    root = str(Path(engine_code.__file__).resolve().parents[2])
    existing = os.environ.get("PYTHONPATH", "")
    return root if not existing else root + os.pathsep + existing


def start_controller(ipp: Any) -> None:
    """Start the cluster's controller; a local one through controller_main.py, which watches this process."""
    from ipyparallel.cluster.launcher import LocalControllerLauncher

    if isinstance(ipp.controller_launcher_class, type) and issubclass(
        ipp.controller_launcher_class, LocalControllerLauncher
    ):
        ipp.start_controller_sync(
            controller_cmd=[sys.executable, str(CONTROLLER_MAIN)], environment={OWNER_ENV: str(os.getpid())}
        )
        return
    ipp.start_controller_sync()  # another launcher's controller: ipyparallel's own command


def start_engines(ipp: Any, launcher: str, gpus: list[int | None], master_addr: str, master_port: int | None) -> None:
    """Start one engine per rank through `launcher` (local: one engine set per rank, with its environment)."""
    world_size = len(gpus)
    prewarm = f"--IPEngine.startup_command={engine_code.PREWARM_COMMAND}"
    common = {"WORLD_SIZE": str(world_size), "PYTHONPATH": _engine_pythonpath()}
    if launcher != "local":
        # mpiexec / srun / ssh give the rank; addresses are settled at init from rank 0.
        # Their engines may run on hosts without this file: ipyparallel's own command.
        ipp.start_engines_sync(n=world_size, environment=common, engine_args=[prewarm])
        return
    for rank, gpu in enumerate(gpus):
        env = dict(
            common,
            **{OWNER_ENV: str(os.getpid())},
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            MASTER_ADDR=master_addr,
        )
        if master_port is not None:  # else the process-group init sets it (Cluster picks it just before)
            env["MASTER_PORT"] = str(master_port)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = str(gpu)
        ipp.start_engines_sync(
            n=1,
            environment=env,
            engine_args=[f"--IPEngine.id={rank}", prewarm],
            engine_cmd=[sys.executable, str(ENGINE_MAIN)],
        )


def map_ranks(client: Any, world_size: int) -> tuple[dict[int, int], dict[int, dict]]:
    """Find which engine holds which rank: the launcher's rank, else engine-id order.

    -> (rank -> engine id, rank -> the engine's facts: host, address, pid, launcher rank).
    """
    ids = sorted(client.ids)
    if len(ids) < world_size:
        raise ClusterError(f"expected {world_size} engines, {len(ids)} registered")
    ids = ids[:world_size]
    facts = client[ids].apply_sync(engine_code.launcher_rank)
    ranks = [f["rank"] for f in facts]
    if sorted(r for r in ranks if r is not None) != list(range(world_size)):
        ranks = list(range(world_size))  # no usable launcher rank: engine-id order
    return dict(zip(ranks, ids)), dict(zip(ranks, facts))


def start_process_group(
    client: Any,
    engine_of_rank: dict[int, int],
    rank_facts: dict[int, dict],
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: str,
) -> list[Any]:
    """Send each rank its torch.distributed init (non-blocking); -> one AsyncResult per rank."""
    hosts = {f["hostname"] for f in rank_facts.values()}
    results = []
    for rank in range(world_size):
        local_rank = rank_facts[rank]["local_rank"]
        if local_rank is None:
            local_rank = rank if len(hosts) == 1 else 0
        results.append(
            client[engine_of_rank[rank]].apply_async(
                engine_code.init_process_group,
                rank,
                world_size,
                local_rank,
                master_addr,
                master_port,
                backend,
            )
        )
    return results


def find_running(cluster_id: str | None, profile: str | None, profile_dir: str | None) -> Any:
    """The ipyparallel Cluster to attach to: the one running (cluster_id None), else the one of that id."""
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
        return found[0]
    try:
        return ipyparallel.Cluster.from_file(profile=profile, profile_dir=profile_dir, cluster_id=cluster_id)
    except FileNotFoundError:
        raise ClusterError(f"no cluster file for cluster_id={cluster_id!r} (profile={profile or 'default'})") from None
