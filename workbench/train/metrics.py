"""Per-step metrics: model FLOPs, memory, expert load. Pure functions, easy to test.

The per-step record every rank emits (to callbacks and to metrics.jsonl) has these fields:
step, rank, loss (the global batch's loss, equal on every rank), grad_norm (global), lr, tokens
(input tokens this rank processed in the step, padding included), tokens_per_s_per_gpu,
tflops_per_gpu, mem_peak_gib / mem_now_gib (mem_kind "cuda_allocated": torch allocator bytes,
peak reset every step; "cpu_rss": process resident set, peak over the process lifetime),
expert_load ([layers][experts] token counts routed from this rank's tokens), expert_load_cv,
step_time_s, forward_s, backward_s, optimizer_s (clip + step), time; with
train.router_bias_update_rate > 0 also router_bias ([layers][experts], after the step's update).
"""

from __future__ import annotations

import math
import resource
import sys
from typing import Any

import torch

from workbench.flops import flops_per_token

GIB = float(1 << 30)


def tflops_per_gpu(cfg: Any, seq_len: int, tokens: int, seconds: float) -> float:
    """Achieved model TFLOP/s on one rank that processed `tokens` tokens in `seconds`."""
    if seconds <= 0:
        return 0.0
    return flops_per_token(cfg, seq_len) * tokens / seconds / 1e12


def expert_load_cv(load: torch.Tensor | list) -> float:
    """Mean over MoE layers of std/mean of tokens per expert (0 = perfectly balanced)."""
    load_t = torch.as_tensor(load, dtype=torch.float64)
    if load_t.numel() == 0:
        return 0.0
    if load_t.dim() == 1:
        load_t = load_t.unsqueeze(0)
    mean = load_t.mean(dim=1)
    std = load_t.std(dim=1, unbiased=False)
    cv = torch.where(mean > 0, std / mean.clamp_min(1e-12), torch.zeros_like(mean))
    return float(cv.mean())


def expert_load_from_router_logits(router_logits: tuple | list, top_k: int, num_experts: int) -> torch.Tensor:
    """Tokens per expert `[layers, experts]` from HF router logits (for vanilla HF models), on their device."""
    rows = []
    for logits in router_logits:
        ids = torch.topk(logits.detach().float(), top_k, dim=-1).indices.reshape(-1)
        # scatter_add into a fixed size, where the data is: no host read (bincount's size needs max(ids))
        rows.append(
            torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
        )
    return torch.stack(rows) if rows else torch.zeros(0, num_experts, dtype=torch.long)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only; CPU peak RSS is process-lifetime)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device: torch.device, hidden: int = 0) -> tuple[float, float, str]:
    """(peak, now, kind): CUDA allocated bytes since the last reset, or the process RSS on CPU.

    `hidden`: bytes the allocator counts as free that are in use all the same (a CUDA graph pool's
    replay memory, train/stack_graphs.py): added to both figures.
    """
    if device.type == "cuda":
        return (
            (torch.cuda.max_memory_allocated(device) + hidden) / GIB,
            (torch.cuda.memory_allocated(device) + hidden) / GIB,
            "cuda_allocated" if not hidden else "cuda_allocated+graph_pool",
        )
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak = peak_kib * (1 if sys.platform == "darwin" else 1024) / GIB  # macOS reports bytes
    try:
        import psutil

        now = psutil.Process().memory_info().rss / GIB
    except ImportError:  # psutil is optional: fall back to /proc on Linux
        now = _proc_rss_gib()
    return peak, now, "cpu_rss"


def _proc_rss_gib() -> float:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
        return pages * resource.getpagesize() / GIB
    except OSError:
        return math.nan


def step_record(
    *,
    step: int,
    rank: int,
    loss: float,
    grad_norm: float,
    lr: float,
    tokens: int,
    seq_len: int,
    hf_config: Any,
    timings: dict[str, float],
    device: torch.device,
    expert_load: torch.Tensor | None,
    **extra: Any,
) -> dict[str, Any]:
    """The per-step, per-rank metrics record (JSON-able)."""
    step_time = timings["step_time_s"]
    peak, now, kind = memory_gib(device)
    load = expert_load.tolist() if expert_load is not None else []
    record = {
        "step": step,
        "rank": rank,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "tokens": tokens,
        "tokens_per_s_per_gpu": tokens / step_time if step_time > 0 else 0.0,
        "tflops_per_gpu": tflops_per_gpu(hf_config, seq_len, tokens, step_time),
        "mem_peak_gib": peak,
        "mem_now_gib": now,
        "mem_kind": kind,
        "expert_load": load,
        "expert_load_cv": expert_load_cv(load) if load else 0.0,
        "step_time_s": step_time,
        "forward_s": timings.get("forward_s", 0.0),
        "backward_s": timings.get("backward_s", 0.0),
        "optimizer_s": timings.get("optimizer_s", 0.0),
    }
    record.update(extra)
    return record
