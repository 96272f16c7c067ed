"""Which device this process computes on; below every other workbench package (no workbench imports)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def default_device() -> torch.device:
    """The device this process would compute on: its local CUDA device, else the CPU.

    LOCAL_RANK is taken modulo the visible devices: a launcher that narrows CUDA_VISIBLE_DEVICES
    to one GPU per rank (the workbench cluster does) leaves each rank one device, index 0. Ranks of
    a gloo-only process group compute on the CPU even where GPUs are visible: gloo has no CUDA
    all-to-all or reduce-scatter (tests/test_expert_parallel.py's gloo ranks, building on the
    CUDA device of an H200 machine, did not finish in 100 s).
    """
    if dist.is_available() and dist.is_initialized() and "nccl" not in str(dist.get_backend()).lower():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    return torch.device("cpu")


def resolve_dtype_name(dtype: str, device_type: str) -> str:
    """The dtype a model.dtype setting trains in on `device_type`: "auto" is bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    return dtype
