"""A cluster's local processes: their pids (controller, engines, engine nannies), and stopping what is left."""

from __future__ import annotations

import socket
import time
from typing import Any

import psutil


def cluster_pids(ipp: Any, engine_of_rank: dict[int, int], rank_facts: dict[int, dict]) -> dict[str, Any]:
    """Local process ids: controller (+ children), each rank's engine, helpers (engine nannies)."""
    out: dict[str, Any] = {"controller": [], "engines": {}, "helpers": []}
    if ipp is None:
        return out
    controller = getattr(ipp, "controller", None)
    pid = getattr(controller, "pid", None) if controller is not None else None
    if pid:
        out["controller"].append(pid)
        try:
            out["controller"] += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    for rank in engine_of_rank:
        if rank in rank_facts:
            out["engines"][rank] = rank_facts[rank]["pid"]
    if not out["engines"]:  # before the ranks were mapped: ask the launchers
        for engine_set in ipp.engines.values():
            for launcher in getattr(engine_set, "launchers", {}).values():
                if getattr(launcher, "pid", None):
                    out["engines"][len(out["engines"])] = launcher.pid
    for pid in out["engines"].values():  # each engine's nanny process, and anything it spawned
        try:
            out["helpers"] += [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return out


def local_engine_pids(rank_facts: dict[int, dict]) -> dict[int, int]:
    """rank -> engine pid for the ranks on this host (whose death we can see directly)."""
    here = socket.gethostname()
    return {r: f["pid"] for r, f in rank_facts.items() if f.get("hostname") == here and f.get("pid")}


def kill_leftovers(pids: dict[str, Any]) -> None:
    """Kill each process of `pids` (as `cluster_pids` gave them) still alive, and wait until it is gone."""
    all_pids = [p for p in pids["controller"] + list(pids["engines"].values()) + pids["helpers"] if p]
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
