"""ipyparallel clusters running on this machine, found through ipyparallel's own cluster files."""

from __future__ import annotations

import os
from typing import Any


class ClusterWatcher:
    """One ipyparallel ClusterManager per server, re-reading cluster files on every snapshot.

    ipyparallel attaches a waiter thread to each running process it loads, so the manager must
    live as long as the server (as ipyparallel's own server extension keeps it): a manager per
    request would start new threads on every poll. Call `snapshot` on the server's event-loop
    thread: the waiters report a process exit through the loop current at load time.
    """

    def __init__(self, parent: Any = None) -> None:
        self._manager = None
        self._import_error: str | None = None
        try:
            from ipyparallel import ClusterManager
        except ImportError as err:
            self._import_error = f"ipyparallel is not installed ({err})"
        else:
            self._manager = ClusterManager(parent=parent)

    def snapshot(self, profile_dirs: list[str] | None = None) -> dict:
        """{"available", "reason", "clusters"}: running clusters and their ranks."""
        if self._manager is None:
            return {"available": False, "reason": self._import_error, "clusters": []}
        return cluster_snapshot(self._manager, profile_dirs)


def cluster_snapshot(manager: Any, profile_dirs: list[str] | None = None) -> dict:
    """Models of the running clusters `manager` finds in the IPython profile dirs."""
    from ipyparallel.util import abbreviate_profile_dir

    # load_clusters re-reads the cluster files ipyparallel keeps in every IPython profile's
    # security/ folder (clusters started from any notebook), dropping ones that stopped.
    clusters = manager.load_clusters(profile_dirs=profile_dirs)
    models = []
    for key, cluster in list(clusters.items()):
        try:
            # ipyparallel deletes a cluster's file when it stops; the waiter threads may only
            # notice the exit a poll later, so a missing file is the prompt signal.
            if not cluster._is_running() or not os.path.exists(cluster.cluster_file):
                manager.clusters.pop(key, None)
                continue
            models.append(_cluster_model(key, cluster.to_dict(), abbreviate_profile_dir))
        except Exception as err:  # one broken cluster file must not hide the others
            models.append({"id": key, "readable": False, "error": f"{type(err).__name__}: {err}"})
    models.sort(key=lambda m: m["id"])
    return {"available": True, "reason": None, "clusters": models}


def _cluster_model(key: str, info: dict, abbreviate: Any) -> dict:
    cluster = info.get("cluster", {})
    controller = (info.get("controller") or {}).get("state") or {}
    engine_sets = (info.get("engines") or {}).get("sets", {})
    # The workbench starts one engine set per rank, in rank order; set ids are start times, so
    # sorting them recovers the rank order. A plain `n=4` cluster is one set of 4 engines.
    ranks = []
    for set_id in sorted(engine_sets):
        engine_set = engine_sets[set_id]
        engines = engine_set.get("engines") or {"0": engine_set}
        for engine_key in sorted(engines, key=lambda k: int(k) if str(k).isdigit() else 0):
            engine = engines[engine_key]
            ranks.append(
                {
                    "rank": len(ranks),
                    "engine_set": set_id,
                    "pid": engine.get("pid"),
                    "state": engine.get("state", engine_set.get("state")),
                    "log": engine.get("output_file"),
                }
            )
    return {
        "id": key,
        "readable": True,
        "cluster_id": cluster.get("cluster_id", ""),
        "profile": abbreviate(cluster.get("profile_dir", "")),
        "profile_dir": cluster.get("profile_dir"),
        "controller": {"pid": controller.get("pid"), "state": controller.get("state")},
        "n_engines": len(ranks),
        "ranks": ranks,
    }
