"""GPT-OSS's expert activation on expert-major rows: per-expert biases and the clamped, interleaved SwiGLU.

Rows are sorted by expert (`tokens_per_expert` rows each, as the dispatchers hand them over). The
torch functions are the reference (Transformers' math with plain ops, runs anywhere); the Triton
ones fuse each step into one pass (CUDA; CPU only under TRITON_INTERPRET=1). Every function takes
`segments` = row_segments(tokens_per_expert, rows), computed once per experts call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F

from workbench.kernels.registry import KernelRegistry


def _triton_gpt_oss_gate():
    """workbench.kernels.triton_gpt_oss_gate, imported when a Triton path first runs: Triton is optional, and it reads
    TRITON_INTERPRET when it is imported."""
    import workbench.kernels.triton_gpt_oss_gate as kernels

    return kernels


# Shape suffixes: N routed rows, E experts, I intermediate (2I: gate and up interleaved), C columns.


class Segments(NamedTuple):
    """Which expert each expert-major row belongs to."""

    tokens_per_expert: torch.Tensor  # [E] rows per expert (device tensor, never read on the host)
    ids: torch.Tensor  # [N] int32 expert of each row
    offsets: torch.Tensor  # [E + 1] int64 first row of each expert, then N


def row_segments(tokens_per_expert: torch.Tensor, rows: int) -> Segments:
    """Per-row expert ids and start offsets for `rows` expert-major rows, without a host sync."""
    E = tokens_per_expert.shape[0]
    ids = torch.repeat_interleave(
        torch.arange(E, dtype=torch.int32, device=tokens_per_expert.device), tokens_per_expert, output_size=rows
    )
    offsets = F.pad(torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int64), (1, 0))
    return Segments(tokens_per_expert, ids, offsets)


def expert_row_bias(bias_EC: torch.Tensor, tokens_per_expert: torch.Tensor, rows: int) -> torch.Tensor:
    """bias[expert of each row] for `rows` expert-major rows, [rows, C] (no host sync: output_size given)."""
    return torch.repeat_interleave(bias_EC, tokens_per_expert, dim=0, output_size=rows)


def gpt_oss_gate_torch(
    h_N2I: torch.Tensor, bias_E2I: torch.Tensor, seg: Segments, alpha: float, limit: float
) -> torch.Tensor:
    """Reference: h + bias[expert], then GptOssExperts._apply_gate's ops (gate/up interleaved)."""
    gate_up = h_N2I + expert_row_bias(bias_E2I, seg.tokens_per_expert, h_N2I.shape[0])
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gpt_oss_gate_triton(
    h_N2I: torch.Tensor, bias_E2I: torch.Tensor, seg: Segments, alpha: float, limit: float
) -> torch.Tensor:
    """Fused Triton version: saves only h; the backward writes dh and the bias gradient in one pass."""
    return _triton_gpt_oss_gate().gate(h_N2I, bias_E2I, seg.ids, seg.offsets, alpha, limit)


def add_row_bias_torch(y_NC: torch.Tensor, bias_EC: torch.Tensor, seg: Segments) -> torch.Tensor:
    """Reference: y + bias[expert of each row] (materializes the repeated bias)."""
    return y_NC + expert_row_bias(bias_EC, seg.tokens_per_expert, y_NC.shape[0])


def add_row_bias_triton(y_NC: torch.Tensor, bias_EC: torch.Tensor, seg: Segments) -> torch.Tensor:
    """In-place Triton add; the bias gradient is a per-expert sum of the incoming gradient (no atomics).

    Only for a `y` no other backward needs (a GEMM output: the GEMM saves its inputs, not its output).
    """
    return _triton_gpt_oss_gate().row_bias_(y_NC, bias_EC, seg.ids, seg.offsets)


GPT_OSS_GATE_BACKENDS = KernelRegistry("gpt_oss gate", {"torch": gpt_oss_gate_torch, "triton": gpt_oss_gate_triton})
ROW_BIAS_BACKENDS = KernelRegistry("gpt_oss gate", {"torch": add_row_bias_torch, "triton": add_row_bias_triton})


def _check(h_N2I: torch.Tensor, bias_E2I: torch.Tensor, seg: Segments, backend: str, table: KernelRegistry) -> Callable:
    impl = table.impl(backend)
    if h_N2I.dim() != 2 or bias_E2I.dim() != 2 or h_N2I.shape[1] != bias_E2I.shape[1]:
        raise ValueError(
            f"expected rows [N, C] and biases [E, C]; got {tuple(h_N2I.shape)} and {tuple(bias_E2I.shape)}"
        )
    if seg.tokens_per_expert.shape[0] != bias_E2I.shape[0] or seg.ids.shape[0] != h_N2I.shape[0]:
        raise ValueError(
            f"segments for {seg.tokens_per_expert.shape[0]} experts / {seg.ids.shape[0]} rows do not "
            f"fit biases of {bias_E2I.shape[0]} experts and {h_N2I.shape[0]} rows"
        )
    return impl


def gpt_oss_gate(
    h_N2I: torch.Tensor, bias_E2I: torch.Tensor, seg: Segments, alpha: float, limit: float, backend: str = "torch"
) -> torch.Tensor:
    """(clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), of h + bias[expert]: [N, 2I] -> [N, I]."""
    fn = _check(h_N2I, bias_E2I, seg, backend, GPT_OSS_GATE_BACKENDS)
    if h_N2I.shape[1] % 2:
        raise ValueError(f"gpt_oss gate: rows need an even width (interleaved gate/up); got {h_N2I.shape[1]}")
    return fn(h_N2I, bias_E2I, seg, alpha, limit)


def add_row_bias(y_NC: torch.Tensor, bias_EC: torch.Tensor, seg: Segments, backend: str = "torch") -> torch.Tensor:
    """y + bias[expert of each row] for expert-major rows."""
    return _check(y_NC, bias_EC, seg, backend, ROW_BIAS_BACKENDS)(y_NC, bias_EC, seg)
