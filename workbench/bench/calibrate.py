"""`workbench bench --calibrate`: time the throughputs the run plan's step time divides by (workbench.plan.throughputs)
on this machine's device, and save them as the JSON the plan reads for this GPU.

    dense GEMM          one [M, K] @ [K, N] in the training dtype (bf16 on CUDA, float32 on a CPU), forward
    grouped GEMM        E experts' rows at each rows-per-expert count through grouped_linear (the experts' GEMM)
    attention           causal scaled_dot_product_attention, forward and backward, at each sequence length; counted
                        as the plan counts it, 6 x heads x head width x S^2 per sequence
    memory-bound        x + 1 over a large tensor: bytes read and written per second
    hybrid mixers       Mamba2's chunked scan and the gated delta rule (workbench.kernels), forward and backward,
                        counted by workbench.mixer_counts' FLOPs per token
Sizes are those of the models the workbench trains on a GPU (Qwen3-30B-A3B's widths) and tiny on a CPU (so a test can
run it in seconds). Each figure is the median of the timed repeats after warm-up.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from workbench.devices import default_device
from workbench.kernels.gated_delta import chunk_gated_delta
from workbench.kernels.ssd_scan import ssd_chunked
from workbench.moe.grouped_linear import grouped_linear, grouped_mm_dtypes
from workbench.plan.gpus import gpu_kind
from workbench.plan.throughputs import CALIBRATION_SCHEMA, calibration_dir, calibration_file_name


@dataclass(frozen=True)
class CalibrationSizes:
    """The shapes timed (module docstring)."""

    gemm: int  # M = N = K of the dense GEMM
    hidden: int  # the grouped GEMM's K
    expert_width: int  # its N (an expert's gate and up projections together)
    experts: int
    rows_per_expert: tuple[int, ...]
    heads: int
    head_dim: int
    seq_lens: tuple[int, ...]
    memory_elements: int
    mixer_tokens: int
    repeats: int


GPU_SIZES = CalibrationSizes(
    8192, 2048, 1536, 128, (16, 64, 256, 1024, 4096), 32, 128, (1024, 4096, 16384, 32768), 1 << 29, 8192, 10
)
CPU_SIZES = CalibrationSizes(256, 64, 96, 4, (4, 16, 64), 2, 16, (64, 128, 256), 1 << 22, 128, 3)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of fn() after two warm-up calls (CUDA: synchronized around each call)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _dense(device: torch.device, dtype: torch.dtype, s: CalibrationSizes) -> float:
    a = torch.randn(s.gemm, s.gemm, device=device, dtype=dtype)
    b = torch.randn(s.gemm, s.gemm, device=device, dtype=dtype)
    seconds = _timed(lambda: a @ b, device, s.repeats)
    return 2 * s.gemm**3 / seconds / 1e12


def _grouped(device: torch.device, dtype: torch.dtype, s: CalibrationSizes, rows: int) -> float:
    weight = torch.randn(s.experts, s.expert_width, s.hidden, device=device, dtype=dtype)  # [E, out, in], as stored
    x = torch.randn(s.experts * rows, s.hidden, device=device, dtype=dtype)
    counts = torch.full((s.experts,), rows, device=device, dtype=torch.int64)
    dtypes = grouped_mm_dtypes(device)
    seconds = _timed(lambda: grouped_linear(x, counts, weight, False, dtypes), device, s.repeats)
    return 2 * s.experts * rows * s.hidden * s.expert_width / seconds / 1e12


def _attention(device: torch.device, dtype: torch.dtype, s: CalibrationSizes, seq: int) -> float:
    q, k, v = (
        torch.randn(1, s.heads, seq, s.head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )

    def step() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(torch.ones_like(out))

    seconds = _timed(step, device, s.repeats)
    return 6 * s.heads * s.head_dim * seq**2 / seconds / 1e12


def _memory(device: torch.device, dtype: torch.dtype, s: CalibrationSizes) -> float:
    x = torch.empty(s.memory_elements, device=device, dtype=dtype)
    seconds = _timed(lambda: x + 1, device, s.repeats)
    return 2 * x.numel() * x.element_size() / seconds / 1e9


def _mixers(device: torch.device, dtype: torch.dtype, s: CalibrationSizes) -> dict[str, float]:
    """TFLOP/s of the two hybrid mixers' scans, forward and backward, at the plan's FLOPs per token."""
    tokens, heads, width, state, groups = s.mixer_tokens, s.heads, s.head_dim, s.head_dim, 1

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=device, dtype=dtype, requires_grad=True)

    x, B, C = randn(1, tokens, heads, width), randn(1, tokens, groups, state), randn(1, tokens, groups, state)
    dt = torch.rand(1, tokens, heads, device=device, dtype=dtype).requires_grad_()
    A = -torch.rand(heads, device=device, dtype=torch.float32)

    def mamba2() -> None:
        ssd_chunked(x, dt, A, B, C, chunk=min(128, tokens)).sum().backward()

    q, k, v = randn(1, tokens, heads, width), randn(1, tokens, heads, width), randn(1, tokens, heads, width)
    g = -torch.rand(1, tokens, heads, device=device, dtype=torch.float32)
    beta = torch.rand(1, tokens, heads, device=device, dtype=dtype)

    def delta() -> None:
        chunk_gated_delta(q, k, v, g, beta, chunk=min(64, tokens)).sum().backward()

    mamba_flops = 21.0 * heads * width * state * tokens  # workbench.mixer_counts: the SSD scan's 21 d N per token
    delta_flops = 6.0 * 4 * heads * width * width * tokens  # its delta rule, 6 x 4 nv dk dv per token
    return {
        "mamba2": mamba_flops / _timed(mamba2, device, s.repeats) / 1e12,
        "gated_deltanet": delta_flops / _timed(delta, device, s.repeats) / 1e12,
    }


def calibrate(device: torch.device, sizes: CalibrationSizes | None = None) -> dict[str, Any]:
    """Every figure of the module docstring on `device`, as the calibration JSON the plan reads."""
    if device.type == "cuda":
        name = torch.cuda.get_device_properties(device).name
        kind = gpu_kind(name)
        if kind is None:
            raise ValueError(f"{name} has no datasheet kind the plan knows (h100, h200, a100): nothing to calibrate")
        dtype, sizes = torch.bfloat16, sizes or GPU_SIZES
    else:
        name, kind, dtype, sizes = "cpu", "cpu", torch.float32, sizes or CPU_SIZES
    return {
        "schema": CALIBRATION_SCHEMA,
        "device_name": name,
        "kind": kind,
        "dtype": str(dtype).removeprefix("torch."),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "dense_tflops": _dense(device, dtype, sizes),
        "grouped_tflops": [[rows, _grouped(device, dtype, sizes, rows)] for rows in sizes.rows_per_expert],
        "attention_tflops": [[seq, _attention(device, dtype, sizes, seq)] for seq in sizes.seq_lens],
        "memory_gbps": _memory(device, dtype, sizes),
        "mixer_tflops": _mixers(device, dtype, sizes),
    }


def save_calibration(data: dict[str, Any], out: Path | None = None) -> Path:
    """Write `data` to `out`, else to the plan's calibration folder under this GPU's name; the path written."""
    path = out if out is not None else calibration_dir() / calibration_file_name(data["device_name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)
    return path


def run(out: str | None) -> int:
    """`workbench bench --calibrate [--out FILE]`: this process's device timed, saved where the plan looks (or `out`);
    the exit code."""
    device = default_device()
    try:
        data = calibrate(device)
    except ValueError as err:  # a GPU the plan has no kind for
        print(f"workbench bench --calibrate: {err}", file=sys.stderr)
        return 2
    path = save_calibration(data, Path(out).expanduser() if out else None)
    print(
        f"wrote {path}: dense GEMM {data['dense_tflops']:.3g} TFLOP/s, memory {data['memory_gbps']:.3g} GB/s "
        f"({data['device_name']}); `workbench plan` uses it for {data['kind']}",
        flush=True,
    )
    return 0
