"""ipyparallel clusters running on this machine, found through ipyparallel's own cluster files."""

from __future__ import annotations

from typing import Any


def cluster_snapshot(profile_dirs: list[str] | None = None) -> dict:
    """{"available": bool, "reason": ..., "clusters": [...]}: running clusters and their ranks."""
    try:
        from ipyparallel import ClusterManager
        from ipyparallel.util import abbreviate_profile_dir
    except ImportError as err:
        return {"available": False, "reason": f"ipyparallel is not installed ({err})", "clusters": []}
    # A fresh manager per request: it re-reads the cluster files ipyparallel keeps in every
    # IPython profile's security/ folder, so clusters started from any notebook show up.
    manager = ClusterManager()
    clusters = manager.load_clusters(profile_dirs=profile_dirs)
    models = []
    for key, cluster in clusters.items():
        try:
            if not cluster._is_running():
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
            ranks.append({
                "rank": len(ranks),
                "engine_set": set_id,
                "pid": engine.get("pid"),
                "state": engine.get("state", engine_set.get("state")),
                "log": engine.get("output_file"),
            })
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
