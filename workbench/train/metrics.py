"""Per-step metrics: model FLOPs, memory, expert load. Pure functions, easy to test.

The per-step record every rank emits (to callbacks and to metrics.jsonl) has these fields:
step, rank, loss (the global batch's loss, equal on every rank), grad_norm (global), lr, tokens
(input tokens this rank processed in the step, padding included), tokens_per_s_per_gpu,
tflops_per_gpu, mem_peak_gib / mem_now_gib (mem_kind "cuda_allocated": torch allocator bytes,
peak reset every step; "cpu_rss": process resident set, peak over the process lifetime),
expert_load ([layers][experts] token counts routed from this rank's tokens), expert_load_cv,
step_time_s, forward_s, backward_s, optimizer_s (clip + step), time.
"""

from __future__ import annotations

import math
import resource
import sys
from typing import Any

import torch

GIB = float(1 << 30)


def _moe_layer_flags(cfg: Any) -> list[bool]:
    """Which decoder layers are MoE for a Qwen3-MoE-style config (mlp_only_layers, sparse step)."""
    layers = cfg.num_hidden_layers
    mlp_only = set(getattr(cfg, "mlp_only_layers", None) or [])
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    num_experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", 0)
    return [i not in mlp_only and num_experts > 0 and (i + 1) % step == 0 for i in range(layers)]


def flops_per_token(cfg: Any, seq_len: int) -> float:
    """Training FLOPs (forward + backward) per token, NeMo AutoModel's `qwen3_flops` formula.

    With L layers, hidden H, heads n_h, KV heads n_kv, head dim d, top-k k, expert width I_e,
    vocab V, sequence S, and r = n_h * d / H:

        attention = 6 * L * H^2 * r * [ (2 * n_kv / n_h + 1)      # Q, K, V projections
                                        + (S / H) * 2 * 0.5       # QK^T and AV, causal half
                                        + 1 ]                     # output projection
        mlp       = 6 * L * H * 3 * I_e * k                       # gate, up, down of k experts
        vocab     = 6 * H * V                                     # lm_head
        per token = attention + mlp + vocab

    i.e. 6 x the matmul parameters a token touches (2 FLOPs per multiply-add, x3 for forward,
    input-grad and weight-grad) plus the causal attention matmuls. Embedding lookup, norms, the
    router gate and softmax are not counted (as in NeMo). Layers that Qwen3-MoE configs mark as
    dense (mlp_only_layers / decoder_sparse_step) count intermediate_size with k = 1; with all
    layers MoE (every Qwen3-MoE release) this is exactly NeMo's number: 23.0 GFLOP/token for
    Qwen3-30B-A3B at S = 4096.
    """
    hidden = cfg.hidden_size
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or hidden // heads
    ratio = heads * head_dim / hidden
    attention_per_layer = 6 * hidden * hidden * ratio * ((2 * kv_heads / heads + 1) + (seq_len / hidden) + 1)
    topk = getattr(cfg, "num_experts_per_tok", 1)
    moe_width = getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size
    mlp = 0.0
    for is_moe in _moe_layer_flags(cfg):
        mlp += 6 * hidden * 3 * (moe_width * topk if is_moe else cfg.intermediate_size)
    vocab = 6 * hidden * cfg.vocab_size
    return cfg.num_hidden_layers * attention_per_layer + mlp + vocab


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
    """Tokens per expert `[layers, experts]` from HF router logits (for vanilla HF models)."""
    rows = []
    for logits in router_logits:
        ids = torch.topk(logits.detach().float(), top_k, dim=-1).indices.flatten()
        rows.append(torch.bincount(ids.cpu(), minlength=num_experts))
    return torch.stack(rows) if rows else torch.zeros(0, num_experts, dtype=torch.long)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only; CPU peak RSS is process-lifetime)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_gib(device: torch.device) -> tuple[float, float, str]:
    """(peak, now, kind): CUDA allocated bytes since the last reset, or the process RSS on CPU."""
    if device.type == "cuda":
        return (torch.cuda.max_memory_allocated(device) / GIB, torch.cuda.memory_allocated(device) / GIB,
                "cuda_allocated")
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


def step_record(*, step: int, rank: int, loss: float, grad_norm: float, lr: float, tokens: int,
                seq_len: int, hf_config: Any, timings: dict[str, float], device: torch.device,
                expert_load: torch.Tensor | None, **extra: Any) -> dict[str, Any]:
    """The per-step, per-rank metrics record (JSON-able)."""
    step_time = timings["step_time_s"]
    peak, now, kind = memory_gib(device)
    load = expert_load.tolist() if expert_load is not None else []
    record = {
        "step": step, "rank": rank, "loss": loss, "grad_norm": grad_norm, "lr": lr, "tokens": tokens,
        "tokens_per_s_per_gpu": tokens / step_time if step_time > 0 else 0.0,
        "tflops_per_gpu": tflops_per_gpu(hf_config, seq_len, tokens, step_time),
        "mem_peak_gib": peak, "mem_now_gib": now, "mem_kind": kind,
        "expert_load": load, "expert_load_cv": expert_load_cv(load) if load else 0.0,
        "step_time_s": step_time, "forward_s": timings.get("forward_s", 0.0),
        "backward_s": timings.get("backward_s", 0.0), "optimizer_s": timings.get("optimizer_s", 0.0),
    }
    record.update(extra)
    return record
