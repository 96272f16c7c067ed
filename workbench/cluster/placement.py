"""Where a cluster's ranks run: the launcher names, and each rank's device, checked before anything starts."""

from __future__ import annotations

from collections.abc import Sequence

from workbench.cluster.errors import ClusterError

# The launchers, by ipyparallel's own engine launcher names (its entry points).
LAUNCHERS = ("local", "mpi", "slurm", "ssh")
DEFAULT_CPU_RANKS = 2


def resolve_devices(n: int | None, devices: str | Sequence[int]) -> tuple[str, list[int | None]]:
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
