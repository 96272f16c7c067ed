"""The files an ipyparallel cluster keeps on this host: which they are, private, and cleaned up."""

from __future__ import annotations

import os
from typing import Any

# Only for this user: ipyparallel writes its cluster file and the processes' output logs with the
# umask (often 0644), its connection files 0600.
PRIVATE_MODE = 0o600


def find(ipp: Any) -> dict[str, list[str]]:
    """By kind: the "cluster" file, "connection" files, the controller's engine "registry", and
    the "logs" (each process's output) of an ipyparallel Cluster."""
    out: dict[str, list[str]] = {"cluster": [], "connection": [], "registry": [], "logs": []}
    if ipp.cluster_file:
        out["cluster"].append(ipp.cluster_file)
    if ipp.controller is not None:
        out["connection"] += list(ipp.controller.connection_files.values())
        out["logs"].append(getattr(ipp.controller, "output_file", None))
    # Where the controller saves which engine has which id (ipyparallel's name; no API has it).
    out["registry"].append(os.path.join(ipp.profile_dir, "log", f"engines{ipp.cluster_id}.json"))
    for engine_set in ipp.engines.values():
        out["logs"].append(getattr(engine_set, "output_file", None))  # mpi/slurm: one per set
        out["logs"] += [
            getattr(launcher, "output_file", None) for launcher in getattr(engine_set, "launchers", {}).values()
        ]
    return {kind: [p for p in paths if p] for kind, paths in out.items()}


def make_private(files: dict[str, list[str]]) -> None:
    """chmod each existing file to PRIVATE_MODE (later rewrites in place keep the mode)."""
    for path in (p for paths in files.values() for p in paths):
        try:
            os.chmod(path, PRIVATE_MODE)
        except FileNotFoundError:
            pass


def remove(paths: list[str]) -> None:
    """Delete each file that exists."""
    for path in paths:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
