"""The machines a run can be planned for: datasheet figures per GPU kind, which kind a device is, and how much
memory a rank may fill.

Datasheet figures (dense bf16 tensor-core peak without sparsity, HBM bandwidth, NVLink per GPU and direction):
    h100  H100 SXM 80 GB   989 TFLOP/s   3.35 TB/s   450 GB/s    torch reports 79.1 GiB
    h200  H200 SXM 141 GB  989 TFLOP/s   4.8 TB/s    450 GB/s    torch reports 139.8 GiB
    a100  A100 SXM 80 GB   312 TFLOP/s   2.04 TB/s   300 GB/s    torch reports 79.2 GiB
    cpu   this host's available memory (psutil, else /proc/meminfo); a nominal 0.2 TFLOP/s and 20 GB/s
A rank may fill its device's memory less RESERVE_GIB: the CUDA context, NCCL's buffers and the caching allocator's
blocks beyond what is allocated (a 48-layer Qwen3-30B-A3B LoRA step died of CUDA OOM with 78.4 GiB allocated on an
H100 whose torch total is 79.1 GiB).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

try:  # the `lab` / `test` extras' psutil; /proc/meminfo where it is missing
    import psutil
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None

GIB = float(1 << 30)
RESERVE_GIB = 1.0


@dataclass(frozen=True)
class GpuSpec:
    """One kind of device, from its datasheet."""

    kind: str
    memory_gib: float  # what torch reports as the device's total memory
    bf16_tflops: float  # dense bf16 tensor-core peak
    memory_gbps: float  # HBM (or host DRAM) bandwidth
    link_gbps: float  # NVLink per GPU per direction (0: none)


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("h100", 79.1, 989.0, 3350.0, 450.0),
    "h200": GpuSpec("h200", 139.8, 989.0, 4800.0, 450.0),
    "a100": GpuSpec("a100", 79.2, 312.0, 2039.0, 300.0),
    "cpu": GpuSpec("cpu", 0.0, 0.2, 20.0, 0.0),  # memory: the host's available memory when planned
}


def gpu_kind(device_name: str) -> str | None:
    """The GPUS key of a device name ("NVIDIA H100 80GB HBM3" -> "h100"), None for one not listed."""
    name = device_name.lower()
    return next((kind for kind in GPUS if kind != "cpu" and kind in name), None)


def host_available_gib() -> float:
    """Memory this host can still give a process, GiB (psutil's available, else /proc/meminfo's MemAvailable)."""
    if psutil is not None:
        return psutil.virtual_memory().available / GIB
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / GIB


def spec_for(gpu: str) -> GpuSpec:
    """The GpuSpec of a kind name (case-insensitive) or a device name; ValueError naming the known kinds."""
    kind = gpu.lower() if gpu.lower() in GPUS else gpu_kind(gpu)
    if kind is None:
        raise ValueError(f"unknown gpu {gpu!r}; known kinds: {sorted(GPUS)} (or pass gpu_memory_gib / --gpu-memory)")
    return GPUS[kind]
